"""The block ledger and the queue in front of it: bounds, fairness, and every ending releasing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvgate.admission.demand import Demand, Slot
from kvgate.config import (
    AdmissionConfig,
    QueueConfig,
)
from kvgate.errors import NeverFits, NoReplica, RateLimited
from kvgate.fleet.replicas import Replica
from kvgate.fleet.scrape import Scrape
from kvgate.state.base import StateStoreError
from tests.admission.harness import Harness, admit, demand, replica
from tests.plugins.waiting import eventually


@pytest.fixture
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """A ledger with target_utilization 1.0 and its pool's dispatcher running; a test may pass
    its own AdmissionConfig with `@pytest.mark.parametrize("harness", [config], indirect=True)`."""
    config = getattr(request, "param", None) or AdmissionConfig(
        target_utilization=1.0, queue=QueueConfig(max_depth=8, max_wait_s=5)
    )
    h = Harness(config)
    task = asyncio.create_task(h.admission.dispatch("p"))
    yield h
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_worst_case_is_reserved_in_blocks_and_released_on_completion(harness):
    r = replica("a")
    async with admit(harness, demand(100), r) as slot:  # ceil(100/16) = 7
        assert slot.blocks == 7 and slot.replica is r
        assert await harness.held(r) == 7
    assert await harness.held(r) == 0


async def test_target_utilization_bounds_the_ledger():
    h = Harness(AdmissionConfig(target_utilization=0.5, queue=QueueConfig(max_wait_s=0.2)))
    r = replica("a", blocks=100)  # admissible: 50 blocks
    async with admit(h, demand(16 * 40), r):
        with pytest.raises(RateLimited) as refused:
            async with admit(h, demand(16 * 11), r):
                pass
        assert refused.value.code == "queue_timeout"
        async with admit(h, demand(16 * 10), r):
            assert await h.held(r) == 50


async def test_a_request_that_can_never_fit_gets_400_with_the_numbers(harness):
    with pytest.raises(NeverFits) as refused:
        async with admit(harness, demand(16 * 101), replica("a"), replica("b", 80)):
            pass
    message = refused.value.message
    assert "1616 tokens = 101 KV blocks" in message and "at most 100 blocks" in message
    assert refused.value.status == 400


async def test_unknown_capacity_is_not_admitted_to(harness):
    with pytest.raises(NoReplica):
        async with admit(harness, demand(16), replica("a", blocks=None)):
            pass


async def test_the_emptier_candidate_is_used_when_the_first_is_full(harness):
    a, b = replica("a", 10), replica("b", 10)
    async with (
        admit(harness, demand(16 * 8), a, b) as first,
        admit(harness, demand(16 * 8), a, b) as second,
    ):
        assert (first.replica, second.replica) == (a, b)


async def test_a_replica_with_a_long_vllm_queue_is_held_back():
    h = Harness(AdmissionConfig(max_replica_waiting=2, queue=QueueConfig(max_wait_s=0.1)))
    busy, calm = replica("busy"), replica("calm")
    busy.scrape = Scrape(at=time.monotonic(), waiting=5)
    async with admit(h, demand(16), busy, calm) as slot:
        assert slot.replica is calm


@pytest.mark.parametrize(
    "harness",
    [AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_depth=100, max_wait_s=10))],
    indirect=True,
)
async def test_concurrent_admits_never_exceed_the_bound(harness):
    r = replica("a", blocks=50)
    peak = 0
    done = 0

    async def one(i: int) -> None:
        nonlocal peak, done
        async with admit(harness, demand(16 * (3 + i % 5), tenant=f"t{i % 3}"), r):
            peak = max(peak, await harness.held(r))
            await asyncio.sleep(0.001 * (i % 4))
        done += 1

    await asyncio.gather(*(one(i) for i in range(60)))
    assert done == 60
    assert 0 < peak <= 50
    assert await harness.held(r) == 0


async def test_body_error_releases(harness):
    r = replica("a")
    with pytest.raises(RuntimeError):
        async with admit(harness, demand(160), r):
            raise RuntimeError("upstream broke")
    assert await harness.held(r) == 0


async def test_cancellation_while_holding_releases(harness):
    r = replica("a")
    entered = asyncio.Event()

    async def hold() -> None:
        async with admit(harness, demand(160), r):
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(hold())
    await entered.wait()
    assert await harness.held(r) == 10
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert await harness.held(r) == 0


async def test_cancellation_while_queued_frees_the_slot(harness):
    r = replica("a", blocks=10)
    async with admit(harness, demand(16 * 10), r):
        waiter = asyncio.create_task(_admit_and_hold(harness, r, 16 * 5))
        await eventually(lambda: len(harness.admission.pool("p").queue) == 1)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert len(harness.admission.pool("p").queue) == 0
    # the dispatcher runs on the release: were anything placed for the leaver, the whole
    # replica could not be admitted again (its blocks held for ever), and this would time out
    async with asyncio.timeout(5), admit(harness, demand(16 * 10), r):
        assert await harness.held(r) == 10
    assert await harness.held(r) == 0


async def test_queued_request_is_admitted_when_capacity_frees(harness):
    r = replica("a", blocks=10)
    release = asyncio.Event()

    async def first() -> None:
        async with admit(harness, demand(16 * 10), r):
            await release.wait()

    holder = asyncio.create_task(first())
    await eventually(lambda: harness.admission.reserved.get("a") == 10)
    held_while_running: list[int] = []

    async def queued() -> Slot:
        async with admit(harness, demand(16 * 6), r) as slot:
            held_while_running.append(await harness.held(r))
            return slot

    waiter = asyncio.create_task(queued())
    await eventually(lambda: len(harness.admission.pool("p").queue) == 1)
    await eventually(lambda: len(harness.admission.pool("p").queue) == 1)
    release.set()
    slot = await asyncio.wait_for(waiter, 5)
    assert slot.queued_s > 0 and slot.blocks == 6
    assert held_while_running == [6]  # a request admitted from the queue holds its blocks
    await holder
    assert await harness.held(r) == 0


async def test_queue_wait_is_bounded_and_the_429_has_a_retry_after():
    h = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_depth=4, max_wait_s=0.1)))
    r = replica("a", blocks=10)
    task = asyncio.create_task(h.admission.dispatch("p"))
    try:
        async with admit(h, demand(16 * 9), r):
            with pytest.raises(RateLimited) as refused:
                async with admit(h, demand(16 * 5), r):
                    pass
        assert refused.value.code == "queue_timeout" and refused.value.status == 429
        assert int(refused.value.headers["Retry-After"]) >= 1
        assert len(h.admission.pool("p").queue) == 0
        assert await h.held(r) == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(
    "harness",
    [AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_depth=2, max_wait_s=5))],
    indirect=True,
)
async def test_full_queue_sheds_the_lowest_class_first(harness):
    r = replica("a", blocks=10)
    async with admit(harness, demand(16 * 10), r):
        low1 = asyncio.create_task(_admit_and_hold(harness, r, 16, "x", "sheddable", hold_s=0))
        low2 = asyncio.create_task(_admit_and_hold(harness, r, 16, "y", "sheddable"))
        await eventually(lambda: len(harness.admission.pool("p").queue) == 2)
        await eventually(lambda: len(harness.admission.pool("p").queue) == 2)
        high = asyncio.create_task(_admit_and_hold(harness, r, 16, "z", "critical", hold_s=0))
        shed = await asyncio.gather(low2, return_exceptions=True)
        assert isinstance(shed[0], RateLimited) and shed[0].code == "queue_full"
        with pytest.raises(RateLimited) as refused:  # no better than the worst class queued
            await _admit_and_hold(harness, r, 16, "w", "sheddable")
        assert refused.value.code == "queue_full"
    slot = await asyncio.wait_for(high, 5)
    assert slot.blocks == 1
    await asyncio.wait_for(low1, 5)
    assert await harness.held(r) == 0


async def test_two_tenants_under_burst_are_admitted_alternately(harness):
    r = replica("a", blocks=4)
    order: list[str] = []
    gate = asyncio.Event()

    async def one(tenant: str, i: int) -> None:
        async with admit(harness, demand(16 * 4, tenant), r):
            order.append(f"{tenant}{i}")
            await asyncio.sleep(0)

    async with admit(harness, demand(16 * 4, "holder"), r):
        tasks = [asyncio.create_task(one("a", i)) for i in range(4)]
        await eventually(lambda: len(harness.admission.pool("p").queue) == 4)
        tasks += [asyncio.create_task(one("b", i)) for i in range(2)]
        await eventually(lambda: len(harness.admission.pool("p").queue) == 6)
        gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]


async def _admit_and_hold(
    h: Harness, r: Replica, tokens: int, tenant: str = "t", priority: str = "standard",
    hold_s: float = 60,
):
    async with admit(h, demand(tokens, tenant, priority), r) as slot:
        await asyncio.sleep(hold_s)
        return slot


def prefixed(tokens: int, prefix_tokens: int, tenant: str = "t") -> Demand:
    return Demand("p", "m", tokens, tenant, "standard", prefix_key="sys", prefix_tokens=prefix_tokens)


async def test_a_shared_prefix_is_reserved_once_per_replica_and_released_with_its_last_user(harness):
    r = replica("a", blocks=100)
    # 20 blocks of prompt+answer, of which a 10-block system prompt: credit 10 - 1 = 9 blocks
    async with admit(harness, prefixed(16 * 20, 16 * 10), r) as first:
        assert (first.blocks, first.shared.blocks) == (11, 9)
        assert await harness.held(r) == 20
        async with admit(harness, prefixed(16 * 20, 16 * 10), r) as second:
            assert second.shared.keys == first.shared.keys and second.blocks == 11
            assert await harness.held(r) == 31  # not 40: the prefix is held once
        assert await harness.held(r) == 20  # the first user still holds the prefix
    assert await harness.held(r) == 0
    assert len(harness.admission.prefixes) == 0


async def test_a_store_failure_after_the_prefix_lease_does_not_leak_it(harness):
    r = replica("a", blocks=100)
    calls = 0
    real = harness.store.try_acquire

    async def failing_second_call(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise StateStoreError("redis went away")
        return await real(*args, **kwargs)

    harness.store.try_acquire = failing_second_call
    with pytest.raises(StateStoreError):
        async with admit(harness, prefixed(16 * 20, 16 * 10), r):
            pass
    assert await harness.held(r) == 0
    assert len(harness.admission.prefixes) == 0
    assert harness.admission.keeper.live_leases() == 0


async def test_a_request_queued_while_every_replica_was_busy_is_placed_once_the_mark_lapses() -> None:
    """Its only replica's vLLM had just refused one as busy (a 50 ms mark): it queues with no
    replica to ask for, and is placed by the next pass after the mark lapses, not after its
    last ranking (which named none) has aged half a second."""
    h = Harness(AdmissionConfig(queue=QueueConfig(max_wait_s=0.3)))
    r = replica("a", blocks=100)
    task = asyncio.create_task(h.admission.dispatch("p"))
    try:
        h.admission.backpressure.refused(r.id, 0.05)
        async with admit(h, demand(16 * 10), r) as slot:
            assert slot.replica is r and slot.queued
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
