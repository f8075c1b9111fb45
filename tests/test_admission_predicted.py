"""Admission on predicted demand: reservations that grow with their answers, a queue without
head-of-line blocking, and early refusal when a request cannot start within its budget."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvgate.admission import Admission
from kvgate.config import AdmissionConfig, QueueConfig
from kvgate.demand import Demand, Slot, growth_target, ledger_key
from kvgate.errors import RateLimited
from kvgate.leases import LeaseKeeper
from kvgate.metrics import Metrics
from kvgate.state.memory import MemoryStore
from tests.test_admission import admit, replica, whole


def predicted(reserve: int, worst: int, tenant: str = "t", priority: str = "standard") -> Demand:
    """A demand with no prompt whose reservation stays `reserve` tokens ahead of its answer."""
    return Demand("p", "m", worst, tenant, priority, ahead_tokens=reserve)


class Gate:
    def __init__(self, config: AdmissionConfig) -> None:
        self.store = MemoryStore()
        self.config = config
        current = whole(config)
        self.admission = Admission(self.store, Metrics(), lambda: current,
                                   LeaseKeeper(self.store, lambda: current))

    async def held(self, r) -> int:
        return await self.store.held(ledger_key(r.id))


@pytest.fixture
async def gate() -> AsyncIterator[Gate]:
    g = Gate(AdmissionConfig(target_utilization=1.0,
                             queue=QueueConfig(max_wait_s=5, wait_budget_s={"standard": 5})))
    tasks = [asyncio.create_task(g.admission.dispatch("p")),
             asyncio.create_task(g.admission.ledger.grow())]
    yield g
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_a_reservation_stays_its_lookahead_ahead_of_the_answer_and_never_past_the_worst_case():
    r = replica("a")
    written = [100]
    slot = Slot(r, "l", blocks=10, worst_blocks=40, progress=lambda: written[0], ahead=64)
    assert growth_target(slot) is None  # 100 written of 160 held: 60 ahead, more than 64 / 2
    written[0] = 130  # 30 ahead: within half the lookahead of the end
    assert growth_target(slot) == 13  # a full lookahead ahead again: (130 + 64) / 16, rounded up
    written[0] = 2000
    assert growth_target(slot) == 40


async def test_predicted_demand_reserves_the_likely_answer_and_grows_with_it(gate):
    r = replica("a", blocks=100)
    written = [0]
    async with admit(gate, predicted(16 * 10, 16 * 60), r) as slot:
        assert await gate.held(r) == 10 and slot.worst_blocks == 60
        slot.progress = lambda: written[0]
        written[0] = 16 * 10  # the answer outran its prediction
        for _ in range(100):
            if await gate.held(r) > 10:
                break
            await asyncio.sleep(0.01)
        assert 10 < await gate.held(r) <= 60
        assert slot.blocks == await gate.held(r)
    assert await gate.held(r) == 0


async def test_predicted_reservations_let_more_requests_in_than_worst_cases(gate):
    r = replica("a", blocks=100)
    async with contextlib_stack(gate, r, [predicted(16 * 10, 16 * 60)] * 9) as slots:
        assert len(slots) == 9 and await gate.held(r) == 90
    worst = Demand("p", "m", 16 * 60, "t", "standard")
    async with admit(gate, worst, r):
        with pytest.raises(TimeoutError):  # a second worst case waits: 120 > 100 blocks
            async with asyncio.timeout(0.3):
                async with admit(gate, worst, r):
                    pass


async def test_a_request_that_fits_nowhere_yet_does_not_hold_back_smaller_ones(gate):
    r = replica("a", blocks=100)
    async with admit(gate, Demand("p", "m", 16 * 60, "t", "standard"), r):
        big = asyncio.create_task(enter(gate, Demand("p", "m", 16 * 50, "t", "standard"), r))
        await asyncio.sleep(0.05)
        async with asyncio.timeout(1):  # passes the big one waiting at the head
            async with admit(gate, Demand("p", "m", 16 * 30, "u", "standard"), r):
                assert await gate.held(r) == 90
        assert not big.done()
    assert await big == 50  # and the big one still gets in once there is room


async def test_a_request_that_cannot_start_within_its_budget_is_refused_at_once():
    g = Gate(AdmissionConfig(target_utilization=1.0,
                             queue=QueueConfig(max_wait_s=30, wait_budget_s={"standard": 1})))
    r = replica("a", blocks=100)
    pool = g.admission._pool("p")
    now = time.monotonic()
    for i in range(4):  # the pool has freed 40 blocks over the last 4 s: 10 per second
        pool.freed.append((now - 4 + i, 10))
    async with admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
        started = time.monotonic()
        with pytest.raises(RateLimited) as refused:
            async with admit(g, Demand("p", "m", 16 * 50, "t", "standard"), r):
                pass
    assert refused.value.code == "wait_budget_exceeded"
    assert time.monotonic() - started < 0.5  # refused, not left to wait
    # 50 blocks needed, 10 free, 10 freed per second: about 4 s
    assert 3 <= refused.value.retry_after_s <= 6


async def enter(gate: Gate, demand: Demand, r) -> int:
    async with admit(gate, demand, r):
        return await gate.held(r)


class contextlib_stack:
    """Admit every demand and hold them all until the block ends."""

    def __init__(self, gate: Gate, r, demands: list[Demand]) -> None:
        self.gate, self.r, self.demands = gate, r, demands
        self.contexts: list = []

    async def __aenter__(self) -> list[Slot]:
        slots = []
        for demand in self.demands:
            admission = self.gate.admission
            context = admission.admit(demand, admission.in_order([self.r]), self.gate.config)
            slots.append(await context.__aenter__())
            self.contexts.append(context)
        return slots

    async def __aexit__(self, *exc: object) -> None:
        for context in reversed(self.contexts):
            await context.__aexit__(None, None, None)


async def test_a_request_never_reserves_less_than_nothing_when_a_larger_prefix_is_shared(gate):
    r = replica("a", blocks=200)
    big_prefix = Demand("p", "m", 16 * 80, "t", "standard", prefix_key="m:sys",
                        prefix_tokens=16 * 70)
    small = Demand("p", "m", 16 * 10, "t", "standard", prefix_key="m:sys", prefix_tokens=16 * 9)
    async with admit(gate, big_prefix, r):
        held = await gate.held(r)
        async with admit(gate, small, r) as slot:
            assert slot.blocks >= 0 and slot.shared is None  # no credit from a larger prefix
            assert await gate.held(r) == held + 10


async def test_a_waiting_critical_request_is_not_passed_by_standard_ones(gate):
    r = replica("a", blocks=100)
    async with admit(gate, Demand("p", "m", 16 * 80, "t", "standard"), r) as first:
        critical = asyncio.create_task(enter(gate, Demand("p", "m", 16 * 50, "vip", "critical"), r))
        await asyncio.sleep(0.05)
        small = asyncio.create_task(enter(gate, Demand("p", "m", 16 * 10, "t", "standard"), r))
        await asyncio.sleep(0.2)
        assert not small.done()  # 10 blocks are free, but the critical request waits for them
        assert first.blocks == 80
    assert await critical in (50, 60)  # it got its 50 first; the small one may follow at once
    await small


async def test_a_request_for_an_idle_replica_is_not_held_behind_one_for_a_full_replica(gate):
    full, idle = replica("full", blocks=100), replica("idle", blocks=100)
    async with admit(gate, Demand("p", "m", 16 * 95, "t", "standard"), full):
        stuck = asyncio.create_task(enter(gate, Demand("p", "m", 16 * 10, "t", "standard"), full))
        await asyncio.sleep(0.05)
        async with asyncio.timeout(1):
            assert await enter(gate, Demand("p", "m", 16 * 20, "u", "standard"), idle) == 20
        assert not stuck.done()
    await stuck


@pytest.fixture
async def slow_gate() -> AsyncIterator[Gate]:
    """A 1-second standard budget on a pool that has been freeing 1 block per second."""
    g = Gate(AdmissionConfig(target_utilization=1.0,
                             queue=QueueConfig(max_wait_s=30, wait_budget_s={"standard": 1})))
    task = asyncio.create_task(g.admission.dispatch("p"))
    pool = g.admission._pool("p")
    now = time.monotonic()
    for i in range(4):
        pool.freed.append((now - 4 + i, 1))
    yield g
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_no_early_refusal_while_the_request_could_start_now(slow_gate):
    r = replica("a", blocks=100)
    async with admit(slow_gate, Demand("p", "m", 16 * 60, "t", "standard"), r):
        # a large request of the same class waits for 80 blocks; a small one fits in the
        # 40 free and may pass it: it is not refused for the large one's wait
        large = asyncio.create_task(enter(slow_gate, Demand("p", "m", 16 * 80, "u", "standard"), r))
        await asyncio.sleep(0.05)
        async with asyncio.timeout(1):
            assert await enter(slow_gate, Demand("p", "m", 16 * 2, "t", "standard"), r) == 62
        large.cancel()
        await asyncio.gather(large, return_exceptions=True)


async def test_behind_a_waiting_critical_request_a_small_one_is_refused_early_not_left_to_wait(
    slow_gate,
):
    r = replica("a", blocks=100)
    async with admit(slow_gate, Demand("p", "m", 16 * 60, "t", "standard"), r):
        critical = asyncio.create_task(
            enter(slow_gate, Demand("p", "m", 16 * 80, "vip", "critical"), r))
        await asyncio.sleep(0.05)
        with pytest.raises(RateLimited) as refused:
            await enter(slow_gate, Demand("p", "m", 16 * 2, "t", "standard"), r)
        assert refused.value.code == "wait_budget_exceeded"
        critical.cancel()
        await asyncio.gather(critical, return_exceptions=True)
