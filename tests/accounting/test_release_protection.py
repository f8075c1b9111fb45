"""Every release runs to its end: through a second cancellation, and past a forgotten lease.

A slow store makes the window real: each release awaits the store long enough for a test to
cancel the request — twice — while it is under way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from kvgate.admission.demand import Demand, ledger_key
from kvgate.admission.leases import LeaseKeeper
from kvgate.admission.stage import Admission
from kvgate.config import AdmissionConfig, QueueConfig, ReplicaConfig, TenantConfig
from kvgate.fleet.replicas import Replica
from kvgate.metrics import Metrics
from kvgate.protect import acquire, finish
from kvgate.state.memory import MemoryStore
from kvgate.tenants import Budgets, tenant_key
from tests.admission.harness import whole
from tests.routing.fleets import in_order


class SlowReleases(MemoryStore):
    """A memory store whose releases, refunds and settlements take `delay_s`, and that says
    when one starts."""

    def __init__(self, delay_s: float = 0.05) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.releasing = asyncio.Event()

    async def release(self, pool: str, lease_id: str) -> int:
        self.releasing.set()
        await asyncio.sleep(self.delay_s)
        return await super().release(pool, lease_id)

    async def put_back(self, bucket: str, amount: int, limit: Any) -> Any:
        self.releasing.set()
        await asyncio.sleep(self.delay_s)
        return await super().put_back(bucket, amount, limit)

    async def settle(self, release: Any, corrections: Any) -> Any:
        self.releasing.set()
        await asyncio.sleep(self.delay_s)
        return await super().settle(release, corrections)


def replica(name: str = "a", blocks: int = 100) -> Replica:
    config = ReplicaConfig(url=f"http://{name}:8000", name=name, num_gpu_blocks=blocks,
                           block_size=16)
    return Replica(config=config, pool="p", healthy=True, models=frozenset({"m"}))


def shared_demand(max_hold_s: float | None = None) -> Demand:
    # 10 prompt blocks, of which the first message's full blocks (less one) are shared
    return Demand("p", "m", 16 * 20, "t", "standard", prefix_key="m:system",
                  prefix_tokens=16 * 10, max_hold_s=max_hold_s)


ADMISSION = AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=1))
CONFIG = whole(ADMISSION)


def admission(store: MemoryStore, keeper: LeaseKeeper | None = None) -> Admission:
    return Admission(store, Metrics(), lambda: CONFIG, keeper or LeaseKeeper(store, lambda: CONFIG))


async def cancel_twice_while_releasing(task: asyncio.Task[Any], store: SlowReleases) -> None:
    await store.releasing.wait()
    task.cancel()
    await asyncio.sleep(store.delay_s / 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_finish_completes_the_release_through_two_cancellations_then_cancels() -> None:
    steps: list[str] = []

    async def release() -> None:
        steps.append("started")
        await asyncio.sleep(0.05)
        steps.append("first half")
        await asyncio.sleep(0.05)
        steps.append("done")

    task = asyncio.create_task(finish(release()))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.06)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["started", "first half", "done"]


async def test_acquire_gives_back_what_a_cancelled_step_took() -> None:
    given_back: list[int] = []

    async def step() -> int:
        await asyncio.sleep(0.05)
        return 7

    async def undo(taken: int) -> None:
        given_back.append(taken)

    task = asyncio.create_task(acquire(step(), undo))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert given_back == [7]


async def test_a_second_cancellation_during_the_ledger_release_still_frees_the_shared_prefix():
    store = SlowReleases()
    gate = admission(store)
    r = replica()

    async def request() -> None:
        async with gate.admit(shared_demand(), in_order(gate, [r]), ADMISSION) as slot:
            assert slot.shared is not None and slot.shared.blocks == 9
            assert await store.held(ledger_key(r.id)) == 20

    task = asyncio.create_task(request())
    await cancel_twice_while_releasing(task, store)
    assert await store.held(ledger_key(r.id)) == 0
    assert len(gate.prefixes) == 0
    assert gate.keeper.live_leases() == 0
    assert gate.reserved.get(r.id, 0) == 0


async def test_a_second_cancellation_during_the_budget_refund_still_frees_the_concurrency_slot():
    store = SlowReleases()
    budgets = Budgets(store, Metrics(), LeaseKeeper(store, lambda: CONFIG))
    tenant = TenantConfig(name="team", max_concurrent=2, tokens_per_minute=10_000)

    async def request() -> None:
        async with budgets.charge(tenant, 1000):
            pass  # ends without settling: the whole charge is refunded on the way out

    task = asyncio.create_task(request())
    await cancel_twice_while_releasing(task, store)
    assert await store.held(tenant_key("team", "concurrency")) == 0
    assert budgets.keeper is not None and budgets.keeper.live_leases() == 0
    state = await store.peek(tenant_key("team", "tokens"), budgets_limit(tenant))
    assert state.remaining == 10_000


def budgets_limit(tenant: TenantConfig) -> Any:
    from kvgate.state.base import BucketLimit

    assert tenant.tokens_per_minute is not None
    return BucketLimit(tenant.tokens_per_minute)


async def test_a_lease_held_past_its_requests_time_limit_is_logged_and_dropped(caplog):
    now = [0.0]
    store = MemoryStore()
    dropped: list[str] = []
    keeper = LeaseKeeper(store, lambda: CONFIG, on_dropped=dropped.append, clock=lambda: now[0])
    gate = admission(store, keeper)
    r = replica()
    # A request whose context is entered and never left: the leak the keeper must catch.
    forgotten = gate.admit(shared_demand(max_hold_s=60.0), in_order(gate, [r]), ADMISSION)
    await forgotten.__aenter__()
    assert await store.held(ledger_key(r.id)) == 20

    now[0] = 59.0
    assert await keeper.drop_stale() == 0
    now[0] = 61.0
    with caplog.at_level(logging.ERROR, logger="kvgate.admission.leases"):
        assert await keeper.drop_stale() == 1
    assert "dropped as leaked" in caplog.text
    assert dropped == ["ledger"]
    assert await store.held(ledger_key(r.id)) == 0
    assert len(gate.prefixes) == 0 and keeper.live_leases() == 0


async def test_a_tenants_concurrency_lease_held_too_long_is_dropped_as_concurrency():
    now = [0.0]
    store = MemoryStore()
    dropped: list[str] = []
    keeper = LeaseKeeper(store, lambda: CONFIG, on_dropped=dropped.append, clock=lambda: now[0])
    budgets = Budgets(store, Metrics(), keeper)
    tenant = TenantConfig(name="team", max_concurrent=2, tokens_per_minute=10_000)
    forgotten = budgets.charge(tenant, 1000, max_hold_s=60.0)
    await forgotten.__aenter__()
    assert await store.held(tenant_key("team", "concurrency")) == 1

    now[0] = 61.0
    assert await keeper.drop_stale() == 1
    assert dropped == ["concurrency"]
    assert await store.held(tenant_key("team", "concurrency")) == 0
