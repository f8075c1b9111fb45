"""RedisStore beyond the contract: several instances, key layout, and Redis going away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio
from redis.crc import key_slot

from kvgate.state.base import BucketCorrection, BucketLimit, BucketTake, LeaseHold, StateStoreError
from kvgate.state.redis import RedisStore
from kvgate.tenants import tenant_key
from tests.plugins.processes import free_port
from tests.plugins.redis_server import PrivateRedis

pytestmark = pytest.mark.redis


@pytest.fixture
async def second_store(redis_url: str, key_prefix: str) -> AsyncIterator[RedisStore]:
    """Another kvgate instance on the same Redis: its own connection pool."""
    store = RedisStore(redis_url, key_prefix=key_prefix, timeout_s=2.0)
    yield store
    await store.close()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    connection = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    yield connection
    await connection.aclose()


async def test_two_instances_racing_on_one_bucket_take_exactly_its_capacity(
    redis_store: RedisStore, second_store: RedisStore
) -> None:
    limit = BucketLimit(capacity=150, period_s=1_000_000)
    takes = [
        store.take("tenant:tpm", 1, limit)
        for _ in range(200)
        for store in (redis_store, second_store)
    ]
    results = await asyncio.gather(*takes)
    assert sum(state.allowed for state in results) == 150


async def test_two_instances_racing_on_one_pool_hold_exactly_its_limit(
    redis_store: RedisStore, second_store: RedisStore
) -> None:
    acquires = [
        store.try_acquire("ledger:replica-a", f"{name}-{i}", 1, limit=37, ttl_s=30)
        for i in range(150)
        for name, store in (("one", redis_store), ("two", second_store))
    ]
    results = await asyncio.gather(*acquires)
    assert sum(results) == 37
    assert await redis_store.held("ledger:replica-a") == 37
    assert await second_store.held("ledger:replica-a") == 37


async def test_two_instances_binding_one_session_agree_on_the_winner(
    redis_store: RedisStore, second_store: RedisStore
) -> None:
    binds = [
        store.bind("session:42", f"replica-{name}-{i}", ttl_s=30)
        for i in range(20)
        for name, store in (("one", redis_store), ("two", second_store))
    ]
    winners = set(await asyncio.gather(*binds))
    assert len(winners) == 1
    assert await second_store.lookup("session:42") in winners


async def test_two_instances_draining_a_bucket_never_exceed_its_rate(
    redis_store: RedisStore, second_store: RedisStore, client: redis.asyncio.Redis
) -> None:
    """Over time, two instances together get one tenant's capacity plus the refill, no more."""
    limit = BucketLimit(capacity=500, period_s=1.0)
    started = await _server_time(client)

    async def drain(store: RedisStore) -> int:
        allowed = 0
        deadline = time.monotonic() + 0.4
        while time.monotonic() < deadline:
            allowed += 10 * (await store.take("tenant:tpm", 10, limit)).allowed
        return allowed

    allowed = sum(await asyncio.gather(drain(redis_store), drain(second_store)))
    elapsed = await _server_time(client) - started
    ceiling = limit.capacity + limit.rate_per_s * elapsed
    assert limit.capacity < allowed <= ceiling


async def test_the_keys_of_one_script_share_a_cluster_slot(redis_store: RedisStore) -> None:
    for pool in ("ledger:replica-a", "concurrency:tenant}x", "{odd}", "a/b/c"):
        slots = {key_slot(key.encode()) for key in redis_store.lease_keys(pool)}
        assert len(slots) == 1
    for key in (*redis_store.lease_keys("p"), redis_store.bucket_key("b")):
        assert key.startswith(f"{{{redis_store.key_prefix}:")


async def test_the_names_of_one_group_share_a_cluster_slot(redis_store: RedisStore) -> None:
    """`group/part` names are tagged by their group, so one script may touch several."""
    keys = [*redis_store.lease_keys("g:1/pool"), redis_store.bucket_key("g:1/a"),
            redis_store.bucket_key("g:1/b"), *redis_store.lease_keys("g:1/other")]  # fmt: skip
    assert len(set(keys)) == len(keys)
    # the slot of the tag `prefix:group`
    assert {key_slot(key.encode()) for key in keys} == {
        key_slot(f"{redis_store.key_prefix}:g:1".encode())
    }


async def test_a_charge_writes_only_its_keys_in_one_slot(
    redis_store: RedisStore, client: redis.asyncio.Redis, key_prefix: str
) -> None:
    limit = BucketLimit(capacity=100)
    hold = LeaseHold("tenant:team/concurrency", "a", 1, 2, ttl_s=30)
    charged = await redis_store.charge(hold, [
        BucketTake("tenant:team/requests", 1, limit), BucketTake("tenant:team/tokens", 50, limit),
    ])  # fmt: skip
    assert charged.granted
    keys = {key async for key in client.scan_iter(match=f"{{{key_prefix}:*")}
    assert keys == {
        *redis_store.lease_keys(hold.pool),
        redis_store.bucket_key("tenant:team/requests"),
        redis_store.bucket_key("tenant:team/tokens"),
    }
    assert len({key_slot(key.encode()) for key in keys}) == 1
    for key in keys:
        assert await client.pttl(key) > 0  # nothing a crashed instance leaves lives forever
    settled = await redis_store.settle(hold, [
        BucketCorrection("tenant:team/tokens", 50, limit),
        BucketCorrection("tenant:team/requests", 1, limit),
    ])  # fmt: skip
    assert settled.released == 1
    assert [key async for key in client.scan_iter(match=f"{{{key_prefix}:*")] == []


def tenant_keys(store: RedisStore, tenant: str) -> list[str]:
    return [
        *store.lease_keys(tenant_key(tenant, "concurrency")),
        store.bucket_key(tenant_key(tenant, "requests")),
        store.bucket_key(tenant_key(tenant, "tokens")),
    ]


@pytest.mark.parametrize("tenant", ["team", "a/b", "odd}name", "{x}", "with:colon", ""])
async def test_a_tenants_pool_and_buckets_share_one_cluster_slot(
    redis_store: RedisStore, tenant: str
) -> None:
    """One charge script touches all five keys: Redis Cluster runs it only if they share a
    slot (CRC16 of the hash tag)."""
    keys = tenant_keys(redis_store, tenant)
    assert len(set(keys)) == 5
    assert len({key_slot(key.encode()) for key in keys}) == 1
    # and they are not the keys of another tenant
    assert not set(keys) & set(tenant_keys(redis_store, tenant + "2"))


async def test_every_key_expires_by_itself(
    redis_store: RedisStore, client: redis.asyncio.Redis, key_prefix: str
) -> None:
    """Nothing a crashed instance leaves behind lives forever."""
    await redis_store.try_acquire("pool", "a", 1, limit=10, ttl_s=30)
    await redis_store.take("bucket", 5, BucketLimit(capacity=10))
    await redis_store.bind("session", "replica-a", ttl_s=30)
    keys = [key async for key in client.scan_iter(match=f"{{{key_prefix}:*")]
    assert len(keys) == 5
    for key in keys:
        assert await client.pttl(key) > 0


async def test_released_pools_and_full_buckets_leave_no_keys(
    redis_store: RedisStore, client: redis.asyncio.Redis, key_prefix: str
) -> None:
    limit = BucketLimit(capacity=10)
    await redis_store.try_acquire("pool", "a", 1, limit=10, ttl_s=30)
    await redis_store.release("pool", "a")
    await redis_store.take("bucket", 5, limit)
    await redis_store.put_back("bucket", 5, limit)
    assert [key async for key in client.scan_iter(match=f"{{{key_prefix}:*")] == []


async def test_scripts_are_loaded_again_after_a_script_flush(
    redis_store: RedisStore, client: redis.asyncio.Redis
) -> None:
    assert await redis_store.try_acquire("pool", "a", 1, limit=10, ttl_s=30)
    await client.script_flush()
    assert await redis_store.held("pool") == 1
    assert (await redis_store.take("bucket", 1, BucketLimit(capacity=10))).allowed
    await client.script_flush()
    hold = LeaseHold("pool", "b", 1, 10, ttl_s=30)
    assert (await redis_store.charge(hold, [])).granted
    await client.script_flush()
    assert (await redis_store.settle(hold, [])).released == 1


async def test_an_unreachable_redis_raises_instead_of_hanging() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.1)
    try:
        with pytest.raises(StateStoreError):
            await store.try_acquire("pool", "a", 1, limit=10, ttl_s=30)
        with pytest.raises(StateStoreError):
            await store.take("bucket", 1, BucketLimit(capacity=10))
        with pytest.raises(StateStoreError):
            await store.lookup("session")
        with pytest.raises(StateStoreError):
            await store.ping()
    finally:
        await store.close()


async def test_the_store_recovers_when_redis_comes_back(private_redis: PrivateRedis) -> None:
    store = RedisStore(private_redis.url, key_prefix="kvgate-test", timeout_s=2.0)
    try:
        assert await store.try_acquire("pool", "a", 1, limit=10, ttl_s=30)
        await private_redis.stop()
        with pytest.raises(StateStoreError):
            await store.held("pool")
        await private_redis.start()
        # The restarted server lost everything (no persistence); the store works at once.
        assert await store.held("pool") == 0
        assert await store.try_acquire("pool", "b", 10, limit=10, ttl_s=30)
    finally:
        await store.close()


async def test_a_restart_between_calls_costs_no_error(private_redis: PrivateRedis) -> None:
    """Pooled connections left stale by a restart are replaced on the spot."""
    store = RedisStore(private_redis.url, key_prefix="kvgate-test", timeout_s=2.0)
    try:
        await store.ping()
        await private_redis.stop()
        await private_redis.start()
        assert await store.bind("session", "replica-a", ttl_s=30) == "replica-a"
    finally:
        await store.close()


async def _server_time(client: redis.asyncio.Redis) -> float:
    seconds, microseconds = await client.time()
    return seconds + microseconds / 1_000_000


async def test_a_release_is_announced_to_every_instance_watching(
    redis_store: RedisStore, second_store: RedisStore
):
    """Instances waiting for capacity learn of another's release at once, not at their next
    poll of the ledger."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    watcher = asyncio.create_task(second_store.watch_releases(heard.put_nowait))
    try:
        await asyncio.sleep(0.2)  # subscribed
        assert await redis_store.try_acquire("ledger:r1", "a", 3, limit=10, ttl_s=30)
        assert await redis_store.release("ledger:r1", "a") == 3
        async with asyncio.timeout(2):
            assert await heard.get() == "ledger:r1"
        hold = LeaseHold("tenant:team/concurrency", "b", 1, 10, ttl_s=30)
        assert (await redis_store.charge(hold, [])).granted
        assert (await redis_store.settle(hold, [])).released == 1
        async with asyncio.timeout(2):
            assert await heard.get() == hold.pool
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def test_a_reply_lost_after_the_commands_were_written_is_never_sent_again(
    redis_store: RedisStore, redis_url: str, key_prefix: str
) -> None:
    # Two takes in one round trip; the connection breaks after the first reply. Both ran in
    # Redis: sending them again on a fresh connection would take 4 units, not 2.
    limit = BucketLimit(capacity=100, period_s=1_000_000)
    await redis_store.peek("bucket", limit)  # bucket.lua loaded: no NOSCRIPT round on the way
    host, port = redis_url.split("//", 1)[1].split("/", 1)[0].split(":")
    connections = 0

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        first = connections == 1
        redis_r, redis_w = await asyncio.open_connection(host, int(port))

        async def upstream() -> None:
            while data := await client_r.read(65536):
                redis_w.write(data)
                await redis_w.drain()

        task = asyncio.create_task(upstream())
        try:
            pending = b""
            while data := await redis_r.read(65536):
                if not first:
                    client_w.write(data)
                    await client_w.drain()
                    continue
                pending += data
                if not pending.startswith(b"*"):  # the handshake's +OK lines pass
                    client_w.write(pending)
                    await client_w.drain()
                    pending = b""
                elif pending.count(b"\r\n") >= 16:  # both replies are in: 8 lines each
                    cut = 0
                    for _ in range(8):  # *4, :allowed, then 3 bulk strings of 2 lines
                        cut = pending.index(b"\r\n", cut) + 2
                    client_w.write(pending[:cut])
                    await client_w.drain()
                    client_w.transport.abort()
                    return
        finally:
            task.cancel()
            redis_w.close()

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    proxy_port = server.sockets[0].getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{proxy_port}/0", key_prefix=key_prefix, timeout_s=2.0)
    try:
        outcomes = await asyncio.gather(
            store.take("bucket", 1, limit), store.take("bucket", 1, limit), return_exceptions=True
        )
        assert all(isinstance(o, StateStoreError) for o in outcomes)
        assert (await redis_store.peek("bucket", limit)).remaining == 98
    finally:
        await store.close()
        server.close()
