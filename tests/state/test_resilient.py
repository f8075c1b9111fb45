"""ResilientStore across a real Redis stopping and coming back, in both failure modes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import pytest

from kvgate.errors import StateStoreUnavailable
from kvgate.state.base import (
    BucketCorrection,
    BucketLimit,
    BucketTake,
    LeaseHold,
    StateStoreError,
)
from kvgate.state.memory import MemoryStore
from kvgate.state.redis import RedisStore
from kvgate.state.resilient import FailureMode, ResilientStore
from tests.plugins.redis_server import PrivateRedis
from tests.plugins.waiting import eventually

pytestmark = pytest.mark.redis

LIMIT = BucketLimit(capacity=100, period_s=100_000.0)
LOGGER = "kvgate.test.state"

StoreFactory = Callable[..., ResilientStore]


@pytest.fixture
async def make_store(private_redis: PrivateRedis) -> AsyncIterator[StoreFactory]:
    stores: list[ResilientStore] = []

    def make(mode: FailureMode, probe_interval_s: float = 0.05) -> ResilientStore:
        primary = RedisStore(private_redis.url, key_prefix="kvgate-test", timeout_s=0.1)
        store = ResilientStore(
            primary,
            MemoryStore(),
            mode,
            probe_interval_s=probe_interval_s,
            logger=logging.getLogger(LOGGER),
        )
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


async def wait_until_up(store: ResilientStore) -> None:
    await eventually(lambda: store.up, timeout_s=10, what="the store noticing Redis came back")


async def test_fail_closed_refuses_while_redis_is_down_and_recovers(
    make_store: StoreFactory, private_redis: PrivateRedis
) -> None:
    store = make_store("fail_closed")
    assert (await store.take("tenant", 10, LIMIT)).remaining == 90
    await private_redis.stop()
    with pytest.raises(StateStoreUnavailable):
        await store.take("tenant", 10, LIMIT)
    with pytest.raises(StateStoreUnavailable):
        await store.try_acquire("pool", "a", 1, limit=10, ttl_s=30)
    assert not store.up
    assert store.fallback_calls == 0
    await private_redis.start()
    await wait_until_up(store)
    assert (await store.take("tenant", 10, LIMIT)).allowed
    assert store.outages == 1
    assert store.outage_seconds > 0


async def test_fail_open_serves_local_limits_while_redis_is_down(
    make_store: StoreFactory, private_redis: PrivateRedis
) -> None:
    store = make_store("fail_open")
    await private_redis.stop()
    assert (await store.take("tenant", 60, LIMIT)).allowed
    assert not (await store.take("tenant", 60, LIMIT)).allowed
    assert await store.bind("session", "replica-a", ttl_s=30) == "replica-a"
    assert await store.lookup("session") == "replica-a"
    assert store.fallback_calls == 4
    assert not store.up


async def test_while_down_requests_do_not_wait_on_redis(
    make_store: StoreFactory, private_redis: PrivateRedis
) -> None:
    """After the first failure, calls short-circuit until a probe succeeds."""
    store = make_store("fail_open", probe_interval_s=3600)  # no probe during this test
    await private_redis.stop()
    for _ in range(50):
        await store.take("tenant", 1, LIMIT)
    assert store.errors == 1
    assert store.fallback_calls == 50


async def test_an_outage_is_logged_once_at_its_start_and_once_at_its_end(
    make_store: StoreFactory, private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    store = make_store("fail_open")
    await private_redis.stop()
    for _ in range(20):
        await store.take("tenant", 1, LIMIT)
    await asyncio.sleep(0.2)  # several failed probes
    await private_redis.start()
    await wait_until_up(store)
    for _ in range(5):
        await store.take("tenant", 1, LIMIT)
    # the local use is then reconciled, and that says so in its own line
    await eventually(lambda: store.reconciled_units, timeout_s=2, what="the reconciliation")
    logged = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    messages = [m for m in logged if "used locally during the outage" not in m]
    assert len(logged) == len(messages) + 1
    assert len(messages) == 2
    assert "down" in messages[0]
    assert "fail_open" in messages[0]
    assert "back after" in messages[1]
    assert "20 calls served by the fallback" in messages[1]


async def test_a_lease_taken_during_an_outage_is_released_after_recovery(
    make_store: StoreFactory, private_redis: PrivateRedis
) -> None:
    store = make_store("fail_open")
    await private_redis.stop()
    assert await store.try_acquire("ledger", "during-outage", 6, limit=10, ttl_s=30)
    await private_redis.start()
    await wait_until_up(store)
    # Still held locally, so it counts against the shared limit on this instance.
    assert await store.held("ledger") == 6
    assert not await store.try_acquire("ledger", "after", 5, limit=10, ttl_s=30)
    assert await store.renew("ledger", ["during-outage"], ttl_s=30) == 1
    assert await store.release("ledger", "during-outage") == 6
    assert await store.release("ledger", "during-outage") == 0
    assert await store.held("ledger") == 0
    assert await store.try_acquire("ledger", "after", 10, limit=10, ttl_s=30)


async def test_a_lease_taken_before_an_outage_is_released_in_redis(
    make_store: StoreFactory, private_redis: PrivateRedis
) -> None:
    store = make_store("fail_open")
    assert await store.try_acquire("ledger", "before", 4, limit=10, ttl_s=30)
    assert await store.release("ledger", "before") == 4
    assert await store.held("ledger") == 0


async def test_ping_probes_the_primary_even_while_down(
    make_store: StoreFactory, private_redis: PrivateRedis
) -> None:
    store = make_store("fail_open")
    assert await store.ping() >= 0
    await private_redis.stop()
    with pytest.raises(StateStoreError):
        await store.ping()
    assert not store.up
    await private_redis.start()
    assert await store.ping() >= 0
    assert store.up
    assert store.outages == 1


async def test_an_unknown_failure_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="failure mode"):
        ResilientStore(MemoryStore(), MemoryStore(), "fail_sideways")  # type: ignore[arg-type]


async def test_fail_open_charges_what_was_used_locally_to_redis_when_it_returns(
    make_store: StoreFactory, private_redis: PrivateRedis
) -> None:
    """An outage must not hand out a second budget: local use is reconciled on recovery."""
    store = make_store("fail_open")
    assert (await store.take("tenant", 10, LIMIT)).remaining == 90
    await private_redis.stop()
    assert (await store.take("tenant", 30, LIMIT)).allowed  # local: 70 left there
    await store.put_back("tenant", 5, LIMIT)  # a refund during the outage counts too
    await private_redis.start()
    await wait_until_up(store)
    await eventually(lambda: store.reconciled_units, timeout_s=2, what="the reconciliation")
    assert store.reconciled_units == 25
    # Redis saw 10 before the outage and Redis was restarted empty (no persistence), so the
    # shared bucket now holds what the outage used: 100 - 25.
    assert (await store.peek("tenant", LIMIT)).remaining == 75


# --- the composite steps ----------------------------------------------------------------------

POOL, REQUESTS, TOKENS = "tenant:t/concurrency", "tenant:t/requests", "tenant:t/tokens"


def hold(lease_id: str, limit: int = 1) -> LeaseHold:
    return LeaseHold(POOL, lease_id, 1, limit, ttl_s=30)


def takes(tokens: int) -> list[BucketTake]:
    return [BucketTake(REQUESTS, 1, LIMIT), BucketTake(TOKENS, tokens, LIMIT)]


@pytest.fixture
async def shared_view(private_redis: PrivateRedis) -> AsyncIterator[RedisStore]:
    """The shared store as another instance sees it (no fallback of its own)."""
    store = RedisStore(private_redis.url, key_prefix="kvgate-test", timeout_s=2.0)
    yield store
    await store.close()


async def test_fail_closed_refuses_charges_and_settlements_while_redis_is_down(
    make_store: StoreFactory, private_redis: PrivateRedis
) -> None:
    store = make_store("fail_closed")
    assert (await store.charge(hold("before"), takes(10))).granted
    await private_redis.stop()
    with pytest.raises(StateStoreUnavailable):
        await store.charge(hold("during", limit=5), takes(10))
    with pytest.raises(StateStoreUnavailable):
        await store.settle(hold("before"), [BucketCorrection(TOKENS, 10, LIMIT)])
    assert store.fallback_calls == 0
    await private_redis.start()
    await wait_until_up(store)
    # the restarted Redis lost everything (no persistence), and nothing was taken locally
    assert await store.held(POOL) == 0
    assert (await store.charge(hold("after"), takes(10))).granted


async def test_fail_open_charges_from_local_limits_all_or_nothing(
    make_store: StoreFactory, private_redis: PrivateRedis
) -> None:
    store = make_store("fail_open")
    await private_redis.stop()
    assert (await store.charge(hold("a", limit=2), takes(60))).granted
    refused = await store.charge(hold("b", limit=2), takes(60))  # the tokens refuse
    assert not refused.granted and refused.lease_fits
    assert await store.held(POOL) == 1  # the refused charge's lease was not kept
    assert (await store.peek(REQUESTS, LIMIT)).remaining == 99
    assert store.fallback_calls == 4
    assert not store.up


async def test_a_lease_charged_during_an_outage_is_settled_in_the_fallback_after_recovery(
    make_store: StoreFactory, private_redis: PrivateRedis, shared_view: RedisStore
) -> None:
    store = make_store("fail_open")
    await private_redis.stop()
    assert (await store.charge(hold("during-outage"), takes(40))).granted
    await private_redis.start()
    await wait_until_up(store)
    # the recovery charges the shared buckets with the outage's use
    await eventually(lambda: store.reconciled_units, timeout_s=2, what="the reconciliation")
    assert (await shared_view.peek(TOKENS, LIMIT)).remaining == 60
    # still held locally: it counts against the shared limit on this instance
    assert await shared_view.held(POOL) == 0
    assert await store.held(POOL) == 1
    assert not (await store.charge(hold("after"), takes(1))).granted
    assert await store.renew(POOL, ["during-outage"], ttl_s=30) == 1
    # released where it is held, corrected in the shared bucket
    settled = await store.settle(hold("during-outage"), [BucketCorrection(TOKENS, 30, LIMIT)])
    assert settled.released == 1
    assert settled.buckets[0].remaining == 90
    assert (await shared_view.peek(TOKENS, LIMIT)).remaining == 90
    assert await store.held(POOL) == 0
    assert (await store.settle(hold("during-outage"), [])).released == 0
    assert (await store.charge(hold("after"), takes(1))).granted
    assert await shared_view.held(POOL) == 1


async def test_a_lease_charged_before_an_outage_is_settled_in_redis(
    make_store: StoreFactory, shared_view: RedisStore
) -> None:
    store = make_store("fail_open")
    assert (await store.charge(hold("before"), takes(50))).granted
    assert await shared_view.held(POOL) == 1
    settled = await store.settle(hold("before"), [BucketCorrection(TOKENS, -10, LIMIT)])
    assert settled.released == 1
    assert settled.buckets[0].remaining == 40
    assert await shared_view.held(POOL) == 0
    assert store.fallback_calls == 0


async def test_fail_open_reconciles_what_local_charges_used_less_local_refunds(
    make_store: StoreFactory, private_redis: PrivateRedis, shared_view: RedisStore
) -> None:
    store = make_store("fail_open")
    await private_redis.stop()
    assert (await store.charge(hold("a"), takes(30))).granted
    await store.settle(hold("a"), [BucketCorrection(TOKENS, 5, LIMIT)])  # refunded locally
    await private_redis.start()
    await wait_until_up(store)
    await eventually(lambda: store.reconciled_units, timeout_s=2, what="the reconciliation")
    assert store.reconciled_units == 25 + 1  # tokens, and the one request
    assert (await shared_view.peek(TOKENS, LIMIT)).remaining == 75
    assert (await shared_view.peek(REQUESTS, LIMIT)).remaining == 99


async def test_re_acquiring_a_fallback_lease_after_recovery_charges_the_shared_buckets(
    make_store: StoreFactory, private_redis: PrivateRedis, shared_view: RedisStore
) -> None:
    """The lease stays where it is held, and the buckets' use still reaches Redis."""
    store = make_store("fail_open")
    await private_redis.stop()
    assert (await store.charge(hold("a", limit=3), [])).granted
    await private_redis.start()
    await wait_until_up(store)
    again = await store.charge(LeaseHold(POOL, "a", 2, 3, ttl_s=30), takes(20))
    assert again.granted
    assert await store.held(POOL) == 2 and await shared_view.held(POOL) == 0
    await eventually(lambda: store.reconciled_units, timeout_s=2, what="the reconciliation")
    assert (await shared_view.peek(TOKENS, LIMIT)).remaining == 80
    assert (await store.settle(hold("a"), [])).released == 2
