"""Admission on predicted demand: reservations that grow with their answers, a queue without
head-of-line blocking, and waiting: for room up to max_wait_s, or — where a latency target is
set — refused at arrival when a request could not start within it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from kvgate.admission.demand import Demand, Slot, growth_target
from kvgate.admission.waiting import LATENESS_WINDOW_S, RERANK_S, PoolQueue, Waiter, Wants
from kvgate.config import AdmissionConfig, QueueConfig
from kvgate.errors import RateLimited
from kvgate.fleet.view import FleetView
from kvgate.routing.ranking import Hold, Ranking
from tests.admission.harness import Harness, admit, refused_behind_a_slow_pool, replica
from tests.plugins.clock import ManualClock
from tests.plugins.waiting import eventually
from tests.routing.fleets import in_order


def predicted(reserve: int, worst: int, tenant: str = "t", priority: str = "standard") -> Demand:
    """A demand with no prompt whose reservation stays `reserve` tokens ahead of its answer."""
    return Demand("p", "m", worst, tenant, priority, ahead_tokens=reserve)


async def queued(gate: Harness, waiting: int) -> None:
    """Until `waiting` requests wait in the pool's queue (a task just made has not yet)."""
    pool = gate.admission.pool("p")
    await eventually(lambda: len(pool.queue) == waiting, what=f"{waiting} waiting")


@pytest.fixture
async def gate() -> AsyncIterator[Harness]:
    g = Harness(AdmissionConfig(target_utilization=1.0,
                             queue=QueueConfig(max_wait_s=5, ttft_target_s={"standard": 5})))
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

        async def grown() -> bool:
            return await gate.held(r) > 10

        await eventually(grown, timeout_s=1, what="the slot grown")
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
        await queued(gate, 1)
        async with asyncio.timeout(1):  # passes the big one waiting at the head
            async with admit(gate, Demand("p", "m", 16 * 30, "u", "standard"), r):
                assert await gate.held(r) == 90
        assert not big.done()
    assert await big == 50  # and the big one still gets in once there is room


async def test_a_request_that_cannot_start_within_its_budget_is_refused_at_once():
    refused = await refused_behind_a_slow_pool(
        QueueConfig(max_wait_s=30, ttft_target_s={"standard": 1})
    )
    assert refused.code == "wait_budget_exceeded"  # at arrival: a wait would end queue_timeout
    # 50 blocks needed, 10 free, 10 freed per second: about 4 s
    assert 3 <= refused.retry_after_s <= 6


async def enter(gate: Harness, demand: Demand, r) -> int:
    async with admit(gate, demand, r):
        return await gate.held(r)


class contextlib_stack:
    """Admit every demand and hold them all until the block ends."""

    def __init__(self, gate: Harness, r, demands: list[Demand]) -> None:
        self.gate, self.r, self.demands = gate, r, demands
        self.contexts: list = []

    async def __aenter__(self) -> list[Slot]:
        slots = []
        for demand in self.demands:
            admission = self.gate.admission
            context = admission.admit(demand, in_order(admission, [self.r]), self.gate.config)
            slots.append(await context.__aenter__())
            self.contexts.append(context)
        return slots

    async def __aexit__(self, *exc: object) -> None:
        for context in reversed(self.contexts):
            await context.__aexit__(None, None, None)


async def test_a_request_whose_prefix_estimate_is_smaller_is_credited_its_own_blocks_only(gate):
    r = replica("a", blocks=200)
    big_prefix = Demand("p", "m", 16 * 80, "t", "standard", prefix_key="m:sys",
                        prefix_tokens=16 * 70)
    small = Demand("p", "m", 16 * 10, "t", "standard", prefix_key="m:sys", prefix_tokens=16 * 9)
    async with admit(gate, big_prefix, r):
        held = await gate.held(r)
        async with admit(gate, small, r) as slot:
            # the first 8 of the 69 shared blocks are its own prefix's: credited, never more
            assert (slot.blocks, slot.shared.blocks) == (2, 8)
            assert await gate.held(r) == held + 2


async def test_a_waiting_critical_request_is_not_passed_by_standard_ones(gate):
    r = replica("a", blocks=100)
    async with admit(gate, Demand("p", "m", 16 * 80, "t", "standard"), r) as first:
        critical = asyncio.create_task(enter(gate, Demand("p", "m", 16 * 50, "vip", "critical"), r))
        await queued(gate, 1)
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
        await queued(gate, 1)
        async with asyncio.timeout(1):
            assert await enter(gate, Demand("p", "m", 16 * 20, "u", "standard"), idle) == 20
        assert not stuck.done()
    await stuck


@pytest.fixture
async def slow_gate() -> AsyncIterator[Harness]:
    """A 1-second standard target on a pool whose requests hold a block 60 s (and a long
    max_wait_s, so that a request without a target is not refused for outwaiting it)."""
    g = Harness(AdmissionConfig(target_utilization=1.0,
                             queue=QueueConfig(max_wait_s=600, ttft_target_s={"standard": 1})))
    task = asyncio.create_task(g.admission.dispatch("p"))
    pool = g.admission.pool("p")
    for _ in range(4):
        pool.released(1, 60.0, time.monotonic())
    yield g
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_no_early_refusal_while_the_request_could_start_now(slow_gate):
    r = replica("a", blocks=100)
    async with admit(slow_gate, Demand("p", "m", 16 * 60, "t", "standard"), r):
        # a large request of the same class (no target of its own: it waits, where one with
        # the pool's 1 s target would be refused at arrival) waits for 80 blocks; a small one
        # fits in the 40 free and may pass it: it is not refused for the large one's wait
        patient = AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=600))

        async def wait_for_80() -> None:
            large_one = Demand("p", "m", 16 * 80, "u", "standard")
            async with slow_gate.admission.admit(
                large_one, in_order(slow_gate.admission, [r]), patient
            ):
                await asyncio.sleep(60)

        large = asyncio.create_task(wait_for_80())
        await queued(slow_gate, 1)
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
        await queued(slow_gate, 1)
        with pytest.raises(RateLimited) as refused:
            await enter(slow_gate, Demand("p", "m", 16 * 2, "t", "standard"), r)
        assert refused.value.code == "wait_budget_exceeded"
        critical.cancel()
        await asyncio.gather(critical, return_exceptions=True)


@contextlib.asynccontextmanager
async def dispatching(gate: Harness) -> AsyncIterator[Harness]:
    """The gate with its pool's dispatcher serving the queue."""
    task = asyncio.create_task(gate.admission.dispatch("p"))
    try:
        yield gate
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def elapse(gate: Harness, clock: ManualClock, seconds: float) -> None:
    """Move the queue's time on by `seconds`, and let the dispatcher make a pass at the new
    time."""
    clock.advance(seconds)
    gate.admission.wake_all()
    await asyncio.sleep(0.05)


def long_holds(gate: Harness, seconds: float = 60.0) -> None:
    """The pool's requests have held their blocks `seconds` each: room frees slowly."""
    pool = gate.admission.pool("p")
    for _ in range(4):
        pool.released(10, seconds, time.monotonic())


async def test_without_a_latency_target_a_request_waits_for_room_however_long_it_takes():
    g = Harness(AdmissionConfig(target_utilization=1.0))  # nothing configured: no target
    long_holds(g)
    r = replica("a", blocks=100)
    async with dispatching(g):
        async with admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
            waiting = asyncio.create_task(enter(g, Demand("p", "m", 16 * 50, "t", "standard"), r))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # expected to wait minutes, yet not refused
        assert await waiting == 50


async def test_free_blocks_spread_over_replicas_do_not_count_as_room_for_one_request():
    """Two replicas with 40 free blocks each: 80 in all, but a 50-block request fits on
    neither. With a 1 s target and requests holding their blocks a minute, it is refused at
    arrival, with the wait until one replica frees 10 more blocks as Retry-After."""
    g = Harness(AdmissionConfig(target_utilization=1.0,
                             queue=QueueConfig(ttft_target_s={"standard": 1})))
    long_holds(g)
    a, b = replica("a", blocks=100), replica("b", blocks=100)
    async with admit(g, Demand("p", "m", 16 * 60, "t", "standard"), a), \
            admit(g, Demand("p", "m", 16 * 60, "t", "standard"), b):
        with pytest.raises(RateLimited) as refused:
            async with admit(g, Demand("p", "m", 16 * 50, "t", "standard"), a, b):
                pass
    assert refused.value.code == "wait_budget_exceeded"
    # 60 held on a replica free 1 block a second: 10 more take about 10 s
    assert 8 <= refused.value.retry_after_s <= 12


async def test_a_request_let_in_waits_past_its_target_rather_than_being_refused_late():
    """Nothing has ended in the pool yet, so nothing says it would miss its 0.1 s target: it
    is let in, and once in, it waits for room up to max_wait_s."""
    clock = ManualClock()
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(
        max_wait_s=30, ttft_target_s={"standard": 0.1})), clock=clock)
    r = replica("a", blocks=100)
    async with dispatching(g):
        async with admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
            waiting = asyncio.create_task(enter(g, Demand("p", "m", 16 * 50, "t", "standard"), r))
            await queued(g, 1)
            await elapse(g, clock, 0.3)
            assert not waiting.done()
        assert await waiting == 50


async def test_a_tenants_latency_target_wins_over_its_class():
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(
        ttft_target_s={"standard": 100})))
    long_holds(g)
    r = replica("a", blocks=100)
    admission = g.admission
    async with admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
        with pytest.raises(RateLimited) as refused:
            async with admission.admit(Demand("p", "m", 16 * 50, "fast", "standard"),
                                       in_order(admission, [r]), g.config, tenant_target_s=1.0):
                pass
    assert refused.value.code == "wait_budget_exceeded"
    assert "latency target of 1s" in refused.value.message


async def test_with_no_target_a_large_request_stops_being_passed_after_half_of_max_wait():
    """Queue aging runs on max_wait_s where no target is set: passed while young, the large
    request holds the replica for itself once it has waited half of it."""
    clock = ManualClock()
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=1.0)), clock=clock)
    r = replica("a", blocks=100)
    async with dispatching(g):
        async with admit(g, Demand("p", "m", 16 * 60, "t", "standard"), r):
            large = asyncio.create_task(enter(g, Demand("p", "m", 16 * 50, "t", "standard"), r))
            await queued(g, 1)
            assert await enter(g, Demand("p", "m", 16 * 10, "u", "standard"), r) == 70  # passes
            await elapse(g, clock, 0.55)  # the large one has aged
            small = asyncio.create_task(enter(g, Demand("p", "m", 16 * 10, "u", "standard"), r))
            await asyncio.sleep(0.15)
            assert not small.done()  # 40 blocks are free, but it may not pass any more
        assert await large in (50, 60)
        await small


async def test_an_aged_request_passed_over_in_a_pass_still_holds_everyone_back():
    """A young request queued ahead (by tenant round robin) is refused first; the aged one
    behind it, larger, is not tried in that pass, and must still hold the replica against a
    small newcomer that would fit in the 40 free blocks."""
    clock = ManualClock()
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=100)), clock=clock)
    patient = g.config  # ages after 50 s
    hurried = AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=1.0))
    r = replica("a", blocks=100)
    admission = g.admission

    async def wait(demand: Demand, config: AdmissionConfig) -> int:
        async with admission.admit(demand, in_order(admission, [r]), config):
            return await g.held(r)

    async with dispatching(g):
        async with admit(g, Demand("p", "m", 16 * 60, "t", "standard"), r):
            young = asyncio.create_task(wait(Demand("p", "m", 16 * 45, "x", "standard"), patient))
            await queued(g, 1)
            aged = asyncio.create_task(wait(Demand("p", "m", 16 * 50, "y", "standard"), hurried))
            await queued(g, 2)
            await elapse(g, clock, 0.55)  # the second has aged; the first, ahead of it, has not
            small = asyncio.create_task(wait(Demand("p", "m", 16 * 10, "z", "standard"), patient))
            await asyncio.sleep(0.1)
            await elapse(g, clock, 0.0)
            assert not small.done()  # 40 blocks are free, but the aged one is not passed
        assert sorted(await asyncio.gather(young, aged)) in ([45, 95], [50, 95])
        await small


async def test_a_pass_over_a_deep_queue_ranks_only_the_requests_it_may_place():
    """Forty requests wait for one full replica. Passes run on every release; each ranks the
    first request again (it is tried) and none of the larger ones behind it while their last
    ranking is younger than RERANK_S, then ranks each once more after it."""
    clock = ManualClock()
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=100)), clock=clock)
    r = replica("a", blocks=100)
    admission = g.admission
    ranked = [0]

    def counted(rank):
        async def counting(waited_s: float):
            ranked[0] += 1
            return await rank(waited_s)
        return counting

    async def wait(blocks: int, tenant: str) -> None:
        ranker = counted(in_order(admission, [r]))
        async with admission.admit(Demand("p", "m", 16 * blocks, tenant, "standard"), ranker, g.config):
            pass

    async with dispatching(g):
        async with admit(g, Demand("p", "m", 16 * 95, "t", "standard"), r):
            waiting = [asyncio.create_task(wait(10 + n, f"u{n}")) for n in range(40)]
            await asyncio.sleep(0.1)
            assert len(admission.pool("p").queue) == 40
            ranked[0] = 0
            for _ in range(5):
                await elapse(g, clock, 0.0)
            assert ranked[0] == 5  # the head of the queue, once a pass
            ranked[0] = 0
            await elapse(g, clock, RERANK_S)
            assert ranked[0] == 40  # rankings gone stale: each ranked afresh, once
            assert not any(task.done() for task in waiting)
        async with asyncio.timeout(5):
            await asyncio.gather(*waiting)  # and each is placed as room frees


async def test_a_replica_that_comes_up_is_taken_by_requests_passed_over_within_rerank_s():
    """The head of the queue may use only the full replica; the two behind it would now also
    rank a new, empty one, but their last ranking (the full one only) says they cannot be
    placed: within RERANK_S they are ranked again, and placed there."""
    clock = ManualClock()
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=100)), clock=clock)
    full, fresh = replica("a", blocks=100), replica("b", blocks=100)
    admission = g.admission
    fleet = [full]

    async def wait(blocks: int, tenant: str, replicas: list) -> None:
        view = FleetView(replicas, admission)  # ranks `replicas` as the list is at each call

        async def rank(waited_s: float):
            return Ranking(list(view.take(admission.current())))

        async with admission.admit(Demand("p", "m", 16 * blocks, tenant, "standard"), rank, g.config):
            await asyncio.sleep(10)  # held until cancelled

    async with dispatching(g), admit(g, Demand("p", "m", 16 * 95, "t", "standard"), full):
        head = asyncio.create_task(wait(10, "x", [full]))
        await queued(g, 1)
        behind = [asyncio.create_task(wait(20 + n, f"y{n}", fleet)) for n in range(2)]
        await queued(g, 3)
        fleet.append(fresh)  # it came up
        await elapse(g, clock, RERANK_S)

        async def placed() -> bool:
            return await g.held(fresh) == 41

        await eventually(placed, timeout_s=2, what="both placed on the new replica")
        assert not head.done()
        for task in (head, *behind):
            task.cancel()
        await asyncio.gather(head, *behind, return_exceptions=True)


async def test_what_a_queued_request_asks_for_follows_its_hold_and_its_ranking():
    clock = ManualClock()
    g = Harness(AdmissionConfig(target_utilization=1.0), clock=clock)
    a, b = replica("a", blocks=100), replica("b", blocks=100, block_size=32)
    views = list(FleetView([a, b], g.admission).take(g.admission.current()))
    future = asyncio.get_running_loop().create_future()
    held = Ranking(views, hold=Hold(views[0], for_s=1.0))
    waiter = Waiter(Demand("p", "m", 16 * 10, "t", "standard"), in_order(g.admission, [a]),
                    future, held, clock(), g.config, clock=clock)
    assert waiter.asks() == Wants(frozenset({"a"}), 10)  # held: its replica only
    clock.advance(1.0)
    assert waiter.asks() == Wants(frozenset({"a", "b"}), 5)  # the hold is over: 32-token blocks
    waiter.ranking = Ranking(views[1:])
    assert waiter.asks() == Wants(frozenset({"b"}), 5)  # ranked again


async def test_newcomers_behind_a_deep_queue_read_each_queued_request_once(monkeypatch):
    """Every arrival reads what the requests queued ahead of it ask for (which replicas they
    wait for, and how many blocks, for its estimate): forty queued, ten newcomers."""
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=100)))
    r = replica("a", blocks=100)
    read = [0]
    wants = Waiter.wants

    def counted(self, waited_s, closed):
        read[0] += 1
        return wants(self, waited_s, closed)

    monkeypatch.setattr(Waiter, "wants", counted)
    long_holds(g, seconds=1.0)  # estimates are made, and short
    async with admit(g, Demand("p", "m", 16 * 95, "t", "standard"), r):
        waiting = [asyncio.create_task(enter(g, Demand("p", "m", 16 * 10, f"u{n}", "standard"), r))
                   for n in range(40)]
        await asyncio.sleep(0.1)
        assert len(g.admission.pool("p").queue) == 40
        read[0] = 0
        waiting += [asyncio.create_task(enter(g, Demand("p", "m", 16 * 10, f"v{n}", "standard"), r))
                    for n in range(10)]
        await asyncio.sleep(0.1)
        assert len(g.admission.pool("p").queue) == 50
        assert read[0] <= 50  # not 40 x 10 x 2: each request's answer is kept
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_request_of_the_same_size_queued_ahead_is_counted_when_nothing_fits_yet():
    """Two 50-block requests wait for one replica that frees 10 blocks a second: the first
    could start in about 4 s, within a 6 s target; the second only after it, in about 9 s."""
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(
        ttft_target_s={"standard": 6})))
    long_holds(g, seconds=9.0)  # 90 held blocks free 10 a second
    r = replica("a", blocks=100)
    async with dispatching(g), admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
        first = asyncio.create_task(enter(g, Demand("p", "m", 16 * 50, "t", "standard"), r))
        await queued(g, 1)
        with pytest.raises(RateLimited) as refused:
            async with asyncio.timeout(2):  # refused at once, not let in to wait
                await enter(g, Demand("p", "m", 16 * 50, "u", "standard"), r)
        assert not first.done()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    assert refused.value.code == "wait_budget_exceeded"
    assert 8 <= refused.value.retry_after_s <= 10


async def test_the_room_a_better_class_keeps_taking_is_not_counted_as_freeing_for_a_lower_one():
    """The critical class has been placed with 5 blocks a second: half of the 10 a second the
    replica frees. A standard request short of 40 blocks waits about 8 s, not 4, and misses a
    6 s target; a critical one of the same size does not."""
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(
        ttft_target_s={"standard": 6, "critical": 6})))
    long_holds(g, seconds=9.0)
    pool = g.admission.pool("p")
    for _ in range(10):  # 50 blocks over the last 10 s
        pool.took("critical", 5, time.monotonic())
    r = replica("a", blocks=100)
    async with admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
        with pytest.raises(RateLimited) as refused:
            async with asyncio.timeout(2):  # refused at once, not let in to wait
                await enter(g, Demand("p", "m", 16 * 50, "t", "standard"), r)
        assert 7 <= refused.value.retry_after_s <= 9
        vip = asyncio.create_task(enter(g, Demand("p", "m", 16 * 50, "vip", "critical"), r))
        await asyncio.sleep(0.1)
        assert not vip.done()  # let in: it waits for its room
        vip.cancel()
        await asyncio.gather(vip, return_exceptions=True)


async def test_a_request_that_missed_its_target_stops_holding_everyone_back():
    """Aged at half its 0.4 s target, a large request holds its replica for itself while it can
    still make the target; once past it, it waits as one without a target would (aging again
    at half of max_wait_s), and smaller requests pass it meanwhile."""
    clock = ManualClock()
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(
        max_wait_s=30, ttft_target_s={"standard": 0.4})), clock=clock)  # nothing ended yet: let in
    r = replica("a", blocks=100)
    async with dispatching(g), admit(g, Demand("p", "m", 16 * 60, "t", "standard"), r):
        large = asyncio.create_task(enter(g, Demand("p", "m", 16 * 50, "t", "standard"), r))
        await queued(g, 1)
        await elapse(g, clock, 0.25)  # aged, within its target
        held_back = asyncio.create_task(enter(g, Demand("p", "m", 16 * 10, "u", "standard"), r))
        await queued(g, 2)
        assert not held_back.done()
        await elapse(g, clock, 0.3)  # past its target: the small one passes
        async with asyncio.timeout(1):
            assert await held_back == 70
        assert not large.done()
        large.cancel()
        await asyncio.gather(large, return_exceptions=True)


def test_how_late_requests_start_against_their_estimate_is_learned_and_forgotten():
    pool = PoolQueue()
    now = time.monotonic()
    for late in (0.5, 1.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0):
        pool.started(0.2, 0.2 + late, now)
    assert pool.corrected_wait(0.5, now) == 3.5  # the 75th percentile, added
    assert pool.corrected_wait(0.5, now + LATENESS_WINDOW_S + 1) == 0.5  # nothing lately


def test_long_estimates_that_came_out_shorter_are_scaled_down_short_ones_are_not():
    pool, now = PoolQueue(), time.monotonic()
    for expected in (2.0, 4.0, 8.0, 10.0, 20.0, 40.0, 50.0, 60.0):
        pool.started(expected, expected / 5, now)  # every one took a fifth of its estimate
    assert pool.corrected_wait(70.0, now) == pytest.approx(14.0)
    assert pool.corrected_wait(0.5, now) == 0.5  # below SCALED_FROM_S: as estimated
    slow = PoolQueue()
    for expected in (2.0, 4.0, 8.0, 10.0, 20.0, 40.0, 50.0, 60.0):
        slow.started(expected, expected * 2, now)
    # never scaled up: the lateness (the 75th percentile of the errors, 40 s) is added instead
    assert slow.corrected_wait(70.0, now) == 110.0


async def test_a_request_estimated_past_max_wait_is_let_in_where_such_estimates_came_true_sooner():
    """Estimated at 9 s against a 5 s max_wait_s it would be refused at arrival; but long
    estimates here have taken a tenth of their time: it waits, and starts when room frees."""
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=5)))
    long_holds(g, seconds=20.0)  # 90 held free 4.5 blocks a second: the 40 missing in 9 s
    pool = g.admission.pool("p")
    for _ in range(8):
        pool.started(10.0, 1.0, time.monotonic())
    r = replica("a", blocks=100)
    async with dispatching(g):
        async with admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
            waiting = asyncio.create_task(enter(g, Demand("p", "m", 16 * 50, "t", "standard"), r))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # let in: it waits for its room
        async with asyncio.timeout(2):
            assert await waiting == 50

async def test_a_request_is_refused_when_requests_like_it_have_been_starting_later_than_estimated():
    """Estimated at 4 s against a 6 s target it would be let in; but requests here have been
    starting 3 s later than their estimates: 7 s is past the target."""
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(
        ttft_target_s={"standard": 6})))
    long_holds(g, seconds=9.0)  # 90 held free 10 blocks a second
    pool = g.admission.pool("p")
    for _ in range(8):
        pool.started(1.0, 4.0, time.monotonic())
    r = replica("a", blocks=100)
    async with admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
        with pytest.raises(RateLimited) as refused:
            async with asyncio.timeout(2):
                await enter(g, Demand("p", "m", 16 * 50, "t", "standard"), r)
    assert refused.value.code == "wait_budget_exceeded"
    assert 6 <= refused.value.retry_after_s <= 8


async def test_headroom_is_told_at_predicted_demand_and_at_the_worst_case():
    """DESIGN.md example 3 on a 1,000-block replica at target 0.9 (900 admissible), 270 blocks
    held by short answers, recent requests of 512 prompt tokens and max_tokens 8,192: their
    worst case (544 blocks) fits once more, their predicted reservation (prompt + a 64-token
    lookahead: 36 blocks) 17 times more. Both figures come from the one fleet snapshot."""
    g = Harness(AdmissionConfig(target_utilization=0.9))
    r = replica("a", blocks=1000)
    recent = Demand("p", "m", 512 + 8192, "t", "standard", ahead_tokens=64, prompt_tokens=512)
    for _ in range(40):
        async with admit(g, recent, r):
            pass
    short = Demand("p", "m", 16 * 27, "t", "standard")  # a worst case of 27 blocks
    async with contextlib_stack(g, r, [short] * 10):
        assert await g.held(r) == 270
        (view,) = FleetView([r], g.admission).take(g.admission.current())
        assert view.headroom_blocks("worst_case") == 900 - 270
        assert view.headroom_requests("worst_case") == (900 - 270) // 544 == 1
        assert view.overcommit == 1.0
        assert view.headroom_blocks("predicted") == 900 - 270
        assert view.headroom_requests("predicted") == (900 - 270) // 36 == 17


@pytest.fixture
async def busy_gate() -> AsyncIterator[Harness]:
    """No latency targets: every request waits for room, up to a 2-second max_wait_s."""
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=2)))
    task = asyncio.create_task(g.admission.dispatch("p"))
    yield g
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_lower_class_is_not_starved_by_a_higher_class_that_keeps_arriving(busy_gate):
    """Two critical clients keep a replica full, each asking again the moment its last
    request ends; a sheddable request waiting for half of it still starts, once it has waited
    half its max_wait_s (it then goes before every younger request, whatever its class),
    instead of timing out behind them."""
    r = replica("a", blocks=100)
    stop = asyncio.Event()

    async def critical_client(name: str) -> int:
        served = 0
        while not stop.is_set():
            async with admit(busy_gate, Demand("p", "m", 16 * 50, name, "critical"), r):
                served += 1
                await asyncio.sleep(0.05)
        return served

    clients = [asyncio.create_task(critical_client(f"vip-{i}")) for i in range(2)]
    await asyncio.sleep(0.1)
    try:
        assert await enter(busy_gate, Demand("p", "m", 16 * 50, "bulk", "sheddable"), r) == 100
    finally:
        stop.set()
        served = await asyncio.gather(*clients)
    assert min(served) > 5  # the critical clients were served all along
