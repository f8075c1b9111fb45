"""MemoryStore on an injected clock: exact expiry and refill arithmetic, no sleeping."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.state.base import BucketLimit
from kvgate.state.memory import MemoryStore
from tests.plugins.clock import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> MemoryStore:
    return MemoryStore(clock=clock)


async def test_a_lease_counts_until_the_instant_it_expires(
    store: MemoryStore, clock: ManualClock
) -> None:
    await store.try_acquire("pool", "a", 5, limit=10, ttl_s=10)
    clock.now += 9.999
    assert await store.held("pool") == 5
    clock.now += 0.001
    assert await store.held("pool") == 0


async def test_renew_pushes_the_expiry_from_now(store: MemoryStore, clock: ManualClock) -> None:
    await store.try_acquire("pool", "a", 5, limit=10, ttl_s=10)
    clock.now += 8
    assert await store.renew("pool", ["a"], ttl_s=10) == 1
    clock.now += 9
    assert await store.held("pool") == 5
    clock.now += 1
    assert await store.renew("pool", ["a"], ttl_s=10) == 0


async def test_refill_is_continuous_at_capacity_per_period(
    store: MemoryStore, clock: ManualClock
) -> None:
    limit = BucketLimit(capacity=600, period_s=60)  # 10 units/s
    await store.take("bucket", 600, limit)
    clock.now += 2.5
    state = await store.peek("bucket", limit)
    assert state.remaining == 25
    assert state.reset_s == pytest.approx(57.5)
    refused = await store.take("bucket", 45, limit)
    assert refused.retry_after_s == pytest.approx(2.0)
    clock.now += 2.0
    assert (await store.take("bucket", 45, limit)).remaining == 0


async def test_debt_is_repaid_by_refill_before_anything_fits(
    store: MemoryStore, clock: ManualClock
) -> None:
    limit = BucketLimit(capacity=100, period_s=10)  # 10 units/s
    forced = await store.take("bucket", 150, limit, force=True)
    assert forced.remaining == -50
    assert forced.reset_s == pytest.approx(15.0)
    clock.now += 5
    assert not (await store.take("bucket", 1, limit)).allowed
    clock.now += 0.1
    assert (await store.take("bucket", 1, limit)).allowed


async def test_refill_never_exceeds_the_capacity(store: MemoryStore, clock: ManualClock) -> None:
    limit = BucketLimit(capacity=100, period_s=10)
    await store.take("bucket", 10, limit)
    clock.now += 3600
    assert (await store.peek("bucket", limit)).remaining == 100


async def test_a_binding_expires_at_its_ttl(store: MemoryStore, clock: ManualClock) -> None:
    await store.bind("session", "replica-a", ttl_s=5)
    clock.now += 4.9
    assert await store.lookup("session") == "replica-a"
    clock.now += 0.1
    assert await store.lookup("session") is None


async def test_expired_bindings_and_full_buckets_do_not_accumulate(
    store: MemoryStore, clock: ManualClock
) -> None:
    limit = BucketLimit(capacity=10, period_s=1)
    for i in range(5_000):
        await store.bind(f"session-{i}", "replica-a", ttl_s=1)
        await store.take(f"bucket-{i}", 1, limit)
        clock.now += 0.01
    assert store.kept_bindings < 2_100
    assert store.kept_buckets < 2_100


async def test_live_bindings_are_bounded_and_the_least_recently_bound_goes_first(
    clock: ManualClock,
) -> None:
    """A client inventing a session key per request cannot grow the store for ttl_s."""
    store = MemoryStore(clock, max_bindings=3)
    for key in ("a", "b", "c"):
        await store.bind(key, "r1", 1800.0)
    await store.bind("a", "r1", 1800.0)  # used again: now the most recent
    await store.bind("d", "r2", 1800.0)
    assert [await store.lookup(k) for k in ("a", "b", "c", "d")] == ["r1", None, "r1", "r2"]
    for i in range(1000):
        await store.bind(f"invented-{i}", "r1", 1800.0)
    assert store.kept_bindings == 3


@given(st.lists(st.tuples(
    st.sampled_from(["acquire", "release", "renew", "wait"]),
    st.sampled_from(["a", "b", "c", "d"]),
    st.integers(1, 6),
    st.sampled_from([0.5, 1.0, 2.0, 3.0]),
), max_size=60))
@settings(max_examples=200, deadline=None)
def test_held_matches_a_scan_of_the_live_leases_through_renewals_and_expiry(
    ops: list[tuple[str, str, int, float]],
) -> None:
    # The store keeps a running total and an expiry heap instead of scanning every lease on
    # every call; a plain model that scans must agree after every step, ties included.
    clock = ManualClock()
    store = MemoryStore(clock=clock)
    model: dict[str, tuple[int, float]] = {}  # lease id -> (amount, expires_at)

    def live() -> dict[str, tuple[int, float]]:
        return {k: v for k, v in model.items() if v[1] > clock.now}

    async def run() -> None:
        for op, lease, amount, seconds in ops:
            alive = live()
            if op == "acquire":
                fits = sum(a for k, (a, _) in alive.items() if k != lease) + amount <= 10
                assert await store.try_acquire("pool", lease, amount, 10, seconds) == fits
                if fits:
                    model[lease] = (amount, clock.now + seconds)
            elif op == "release":
                assert await store.release("pool", lease) == alive.get(lease, (0, 0))[0]
                model.pop(lease, None)
            elif op == "renew":
                assert await store.renew("pool", [lease], seconds) == (lease in alive)
                if lease in alive:
                    model[lease] = (alive[lease][0], clock.now + seconds)
            else:
                clock.now += seconds
            assert await store.held("pool") == sum(a for a, _ in live().values())

    asyncio.run(run())
