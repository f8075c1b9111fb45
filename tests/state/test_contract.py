"""The StateStore contract (kvgate/state/base.py), checked against every implementation.

Time passes through `store_time.advance(seconds)`: the memory store's clock moves at once, and
Redis, which keeps its own clock, is waited out for real. So expiry and refill tests use short
TTLs and periods and only assert what a slow machine cannot break: that something has expired
after waiting longer than its TTL, never how little time something took.
"""

from __future__ import annotations

import asyncio

import pytest

from kvgate.state.base import BucketLimit, StateStore
from tests.plugins.clock import StoreTime

# Refill is negligible over a test: 100 units per 100,000 s.
SLOW = BucketLimit(capacity=100, period_s=100_000.0)


# --- leases -----------------------------------------------------------------------------------


async def test_acquire_holds_units_up_to_the_limit(store: StateStore) -> None:
    assert await store.try_acquire("pool", "a", 6, limit=10, ttl_s=30)
    assert await store.try_acquire("pool", "b", 4, limit=10, ttl_s=30)
    assert not await store.try_acquire("pool", "c", 1, limit=10, ttl_s=30)
    assert await store.held("pool") == 10


async def test_a_lease_larger_than_the_limit_is_refused_on_an_empty_pool(
    store: StateStore,
) -> None:
    assert not await store.try_acquire("pool", "a", 11, limit=10, ttl_s=30)
    assert await store.held("pool") == 0


async def test_pools_are_independent(store: StateStore) -> None:
    assert await store.try_acquire("pool-1", "a", 10, limit=10, ttl_s=30)
    assert await store.try_acquire("pool-2", "a", 10, limit=10, ttl_s=30)
    assert await store.held("pool-1") == 10
    assert await store.held("pool-2") == 10


async def test_reacquiring_a_lease_replaces_its_amount(store: StateStore) -> None:
    assert await store.try_acquire("pool", "a", 5, limit=10, ttl_s=30)
    assert await store.try_acquire("pool", "a", 9, limit=10, ttl_s=30)
    assert await store.held("pool") == 9
    assert await store.try_acquire("pool", "a", 2, limit=10, ttl_s=30)
    assert await store.held("pool") == 2


async def test_a_refused_reacquire_keeps_the_lease_as_it_was(store: StateStore) -> None:
    assert await store.try_acquire("pool", "a", 5, limit=10, ttl_s=30)
    assert await store.try_acquire("pool", "b", 3, limit=10, ttl_s=30)
    assert not await store.try_acquire("pool", "a", 8, limit=10, ttl_s=30)
    assert await store.held("pool") == 8
    assert await store.release("pool", "a") == 5


async def test_release_frees_the_units_exactly_once(store: StateStore) -> None:
    assert await store.try_acquire("pool", "a", 7, limit=10, ttl_s=30)
    assert await store.release("pool", "a") == 7
    assert await store.release("pool", "a") == 0
    assert await store.held("pool") == 0
    assert await store.try_acquire("pool", "b", 10, limit=10, ttl_s=30)


async def test_releasing_an_unknown_lease_frees_nothing(store: StateStore) -> None:
    assert await store.try_acquire("pool", "a", 3, limit=10, ttl_s=30)
    assert await store.release("pool", "nope") == 0
    assert await store.release("other-pool", "a") == 0
    assert await store.held("pool") == 3


async def test_an_expired_lease_returns_its_capacity(
    store: StateStore, store_time: StoreTime
) -> None:
    assert await store.try_acquire("pool", "crashed", 8, limit=10, ttl_s=0.1)
    assert await store.try_acquire("pool", "alive", 2, limit=10, ttl_s=30)
    await store_time.advance(0.2)
    assert await store.held("pool") == 2
    assert await store.release("pool", "crashed") == 0
    assert await store.try_acquire("pool", "new", 8, limit=10, ttl_s=30)
    assert await store.held("pool") == 10


async def test_renew_keeps_a_lease_alive_and_counts_the_live_ones(
    store: StateStore, store_time: StoreTime
) -> None:
    assert await store.try_acquire("pool", "a", 4, limit=10, ttl_s=0.3)
    assert await store.try_acquire("pool", "b", 3, limit=10, ttl_s=0.3)
    assert await store.renew("pool", ["a", "unknown"], ttl_s=30) == 1
    await store_time.advance(0.4)
    assert await store.held("pool") == 4
    assert await store.renew("pool", ["a", "b"], ttl_s=30) == 1
    assert await store.renew("pool", [], ttl_s=30) == 0


async def test_concurrent_acquires_never_exceed_the_limit(store: StateStore) -> None:
    results = await asyncio.gather(
        *(store.try_acquire("pool", f"lease-{i}", 1, limit=50, ttl_s=30) for i in range(200))
    )
    assert sum(results) == 50
    assert await store.held("pool") == 50


# --- token buckets ----------------------------------------------------------------------------


async def test_a_new_bucket_is_full(store: StateStore) -> None:
    state = await store.peek("bucket", SLOW)
    assert state.allowed
    assert state.remaining == 100
    assert state.reset_s == 0


async def test_take_is_all_or_nothing(store: StateStore) -> None:
    first = await store.take("bucket", 70, SLOW)
    assert first.allowed
    assert first.remaining == 30
    refused = await store.take("bucket", 31, SLOW)
    assert not refused.allowed
    assert refused.remaining == 30
    assert (await store.take("bucket", 30, SLOW)).allowed
    assert (await store.take("bucket", 0, SLOW)).allowed
    assert (await store.peek("bucket", SLOW)).remaining == 0


async def test_retry_after_is_the_time_until_the_amount_fits(store: StateStore) -> None:
    await store.take("bucket", 90, SLOW)
    refused = await store.take("bucket", 30, SLOW)
    # 20 units missing at 0.001 units/s.
    assert refused.retry_after_s == pytest.approx(20_000, abs=5)
    assert refused.reset_s == pytest.approx(90_000, abs=5)


async def test_more_than_the_capacity_is_refused_with_the_time_to_a_full_bucket(
    store: StateStore,
) -> None:
    full = await store.take("bucket", 101, SLOW)
    assert not full.allowed
    assert full.retry_after_s == pytest.approx(0, abs=1e-6)
    await store.take("bucket", 40, SLOW)
    refused = await store.take("bucket", 500, SLOW)
    assert not refused.allowed
    assert refused.remaining == 60
    assert refused.retry_after_s == pytest.approx(40_000, abs=5)
    assert refused.retry_after_s == pytest.approx(refused.reset_s)


async def test_force_take_goes_into_debt(store: StateStore) -> None:
    await store.take("bucket", 80, SLOW)
    forced = await store.take("bucket", 50, SLOW, force=True)
    assert forced.allowed
    assert forced.remaining == -30
    assert forced.reset_s == pytest.approx(130_000, abs=5)
    refused = await store.take("bucket", 10, SLOW)
    assert not refused.allowed
    assert refused.retry_after_s == pytest.approx(40_000, abs=5)


async def test_put_back_refunds_up_to_the_capacity(store: StateStore) -> None:
    await store.take("bucket", 60, SLOW)
    refunded = await store.put_back("bucket", 25, SLOW)
    assert refunded.remaining == 65
    capped = await store.put_back("bucket", 1_000, SLOW)
    assert capped.remaining == 100
    assert capped.reset_s == 0


async def test_peek_does_not_change_the_bucket(store: StateStore) -> None:
    await store.take("bucket", 99, SLOW)
    for _ in range(3):
        state = await store.peek("bucket", SLOW)
        assert state.allowed
        assert state.remaining == 1
    await store.take("bucket", 1, SLOW)
    empty = await store.peek("bucket", SLOW)
    assert not empty.allowed
    assert empty.retry_after_s == pytest.approx(1_000, abs=5)


async def test_a_bucket_refills_continuously(store: StateStore, store_time: StoreTime) -> None:
    fast = BucketLimit(capacity=10, period_s=1.0)
    assert (await store.take("bucket", 10, fast)).allowed
    assert not (await store.take("bucket", 3, fast)).allowed
    await store_time.advance(0.35)  # at least 3.5 units back
    assert (await store.take("bucket", 3, fast)).allowed


async def test_buckets_are_independent(store: StateStore) -> None:
    await store.take("bucket-1", 100, SLOW)
    assert (await store.take("bucket-2", 100, SLOW)).allowed


async def test_a_bucket_without_capacity_is_a_caller_error(store: StateStore) -> None:
    with pytest.raises(ValueError, match="capacity"):
        await store.take("bucket", 1, BucketLimit(capacity=0))


# --- bindings ---------------------------------------------------------------------------------


async def test_bind_sets_an_unbound_key(store: StateStore) -> None:
    assert await store.lookup("session") is None
    assert await store.bind("session", "replica-a", ttl_s=30) == "replica-a"
    assert await store.lookup("session") == "replica-a"


async def test_the_first_binding_wins(store: StateStore) -> None:
    """Another instance that bound the key first keeps it; the caller learns its value."""
    assert await store.bind("session", "replica-a", ttl_s=30) == "replica-a"
    assert await store.bind("session", "replica-b", ttl_s=30) == "replica-a"
    assert await store.bind("session", "replica-a", ttl_s=30) == "replica-a"
    assert await store.lookup("session") == "replica-a"


async def test_compare_and_set_rebinds_only_from_the_expected_value(store: StateStore) -> None:
    await store.bind("session", "replica-a", ttl_s=30)
    assert await store.bind("session", "replica-c", ttl_s=30, replace="replica-b") == "replica-a"
    assert await store.bind("session", "replica-b", ttl_s=30, replace="replica-a") == "replica-b"
    assert await store.lookup("session") == "replica-b"


async def test_a_binding_expires_after_its_ttl(store: StateStore, store_time: StoreTime) -> None:
    await store.bind("session", "replica-a", ttl_s=0.1)
    await store_time.advance(0.2)
    assert await store.lookup("session") is None
    assert await store.bind("session", "replica-b", ttl_s=30) == "replica-b"


async def test_rebinding_to_the_same_value_refreshes_the_ttl(
    store: StateStore, store_time: StoreTime
) -> None:
    await store.bind("session", "replica-a", ttl_s=0.3)
    await store.bind("session", "replica-a", ttl_s=30)
    await store_time.advance(0.4)
    assert await store.lookup("session") == "replica-a"


async def test_unbind_removes_the_binding(store: StateStore) -> None:
    await store.bind("session", "replica-a", ttl_s=30)
    await store.unbind("session")
    await store.unbind("session")
    assert await store.lookup("session") is None
    assert await store.bind("session", "replica-b", ttl_s=30) == "replica-b"


async def test_ping_reports_a_round_trip(store: StateStore) -> None:
    assert await store.ping() >= 0
