"""The Redis StateStore: state shared by every kvgate instance on one Redis.

Each operation is one Lua script (kvgate/state/lua/), so N instances enforce one limit with no
read-then-write race, and the scripts read Redis's own clock (`TIME`) for expiry and refill, so
instances with skewed clocks agree. Scripts are called by SHA and loaded again when Redis answers
NOSCRIPT (after a restart or SCRIPT FLUSH).

Keys carry the configured prefix and a Redis Cluster hash tag per name group (base.py: a
name `<group>/<part>` groups with its group's other names; a name without `/` is a group of
its own): `{prefix:ledger:r1}:leases`, `{prefix:tenant:team}/concurrency:leases`,
`{prefix:tenant:team}/tokens:bucket`. So a script's keys share one slot, a tenant's composite
`charge` and `settle` included, and a single call on any of those names (a renewal, a peek,
a release) addresses the very keys the composite step uses.

The lease and bucket logic lives once, as Lua functions in lua/lib/; each script is those
files followed by its own body (`kvgate.state.pipeline.Script`), so every script that holds a lease or takes from
a bucket runs the same code.

Calls are pipelined (`kvgate.state.pipeline`): every call made in one turn of the event loop —
by this request and by every other in flight — goes to Redis in one round trip (per-call round
trips would be most of the store's CPU under concurrency), and the composite steps save the
calls themselves. `round_trips` and `calls` count them for /metrics.

Timeouts are short (connect, read and waiting for a pooled connection), with one immediate retry
on a fresh connection when one breaks before any reply came, so a connection left stale by a
Redis restart costs nothing (once a reply came, the rest are never sent again: their scripts
may have run); a dead Redis
raises StateStoreError within a few timeouts instead of hanging a request. Every Redis failure
becomes StateStoreError. The connection pool reconnects by itself when Redis comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from kvgate.state.base import (
    BucketCorrection,
    BucketLimit,
    BucketState,
    BucketTake,
    Charged,
    LeaseHold,
    Settled,
    StateStoreError,
)
from kvgate.state.memory import check_buckets, check_limit, remaining_units
from kvgate.state.pipeline import Pipeline, Script, ScriptArg

log = logging.getLogger(__name__)
RESUBSCRIBE_S = 0.5


class RedisStore:
    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "kvgate",
        timeout_s: float = 0.25,
        max_connections: int = 64,
    ) -> None:
        self.key_prefix = key_prefix
        self._pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=max(1.0, 4 * timeout_s),  # waiting for a free pooled connection
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # Retry once, at once, on a connection error (a stale pooled connection), never on a
            # timeout: the script may have run, and a second `take` would charge twice.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            decode_responses=True,
        )
        self._redis = Redis(connection_pool=self._pool)
        self._pipeline = Pipeline(self._pool, self._redis)
        self._lease = Script("lease", ("clock", "leases"))
        self._bucket = Script("bucket", ("clock", "buckets"))
        self._charge = Script("charge", ("clock", "leases", "buckets"))
        self._settle = Script("settle", ("clock", "leases", "buckets"))
        self._bind = Script("bind")

    @property
    def round_trips(self) -> int:
        """Pipelines sent."""
        return self._pipeline.round_trips

    @property
    def calls(self) -> int:
        """Commands sent in them."""
        return self._pipeline.calls

    # --- keys (one hash tag per name group, or per binding) ----------------------------------

    def _tagged(self, name: str) -> str:
        """`{prefix:group}/part` for a name `group/part`, `{prefix:name}` for one without."""
        group, slash, part = name.rpartition("/")
        if not slash:
            return f"{{{self.key_prefix}:{name}}}"
        return f"{{{self.key_prefix}:{group}}}/{part}"

    def lease_keys(self, pool: str) -> tuple[str, str, str]:
        key = self._tagged(pool)
        return f"{key}:leases", f"{key}:amounts", f"{key}:held"

    @property
    def releases_channel(self) -> str:
        return f"{self.key_prefix}:released"

    def bucket_key(self, bucket: str) -> str:
        return f"{self._tagged(bucket)}:bucket"

    def binding_key(self, key: str) -> str:
        return f"{{{self.key_prefix}:{key}}}:binding"

    # --- leases -------------------------------------------------------------------------------

    async def try_acquire(
        self, pool: str, lease_id: str, amount: int, limit: int, ttl_s: float
    ) -> bool:
        args = ("acquire", lease_id, amount, limit, _ms(ttl_s))
        return bool(await self._pipeline.run(self._lease, self.lease_keys(pool), args))

    async def release(self, pool: str, lease_id: str) -> int:
        args = ("release", lease_id, self.releases_channel, pool)
        return _int(await self._pipeline.run(self._lease, self.lease_keys(pool), args))

    async def renew(self, pool: str, lease_ids: list[str], ttl_s: float) -> int:
        if not lease_ids:
            return 0
        args = ("renew", _ms(ttl_s), *lease_ids)
        return _int(await self._pipeline.run(self._lease, self.lease_keys(pool), args))

    async def held(self, pool: str) -> int:
        return _int(await self._pipeline.run(self._lease, self.lease_keys(pool), ("held",)))

    # --- token buckets ------------------------------------------------------------------------

    async def take(
        self, bucket: str, amount: int, limit: BucketLimit, *, force: bool = False
    ) -> BucketState:
        return await self._bucket_op(bucket, "force" if force else "take", amount, limit)

    async def put_back(self, bucket: str, amount: int, limit: BucketLimit) -> BucketState:
        return await self._bucket_op(bucket, "put_back", amount, limit)

    async def peek(self, bucket: str, limit: BucketLimit) -> BucketState:
        """What `take(bucket, 1, limit)` would answer, without taking."""
        return await self._bucket_op(bucket, "peek", 1, limit)

    async def _bucket_op(
        self, bucket: str, op: str, amount: int, limit: BucketLimit
    ) -> BucketState:
        check_limit(limit)
        args = (op, amount, limit.capacity, repr(float(limit.period_s)))
        reply = await self._pipeline.run(self._bucket, (self.bucket_key(bucket),), args)
        return _parse(reply, 0, 1, "bucket.lua")[1][0]

    # --- composite steps ----------------------------------------------------------------------

    async def charge(self, lease: LeaseHold | None, takes: Sequence[BucketTake]) -> Charged:
        check_buckets(takes)
        keys: list[str] = []
        args: list[ScriptArg] = ["0"]
        if lease is not None:
            keys += self.lease_keys(lease.pool)
            args = ["1", lease.lease_id, lease.amount, lease.limit, _ms(lease.ttl_s)]
        for take in takes:
            keys.append(self.bucket_key(take.bucket))
            args += (take.amount, take.limit.capacity, repr(float(take.limit.period_s)))
        reply = await self._pipeline.run(self._charge, keys, args)
        (fits,), states = _parse(reply, 1, len(takes), "charge.lua")
        return Charged(lease_fits=bool(fits), buckets=states)

    async def settle(
        self, release: LeaseHold | None, corrections: Sequence[BucketCorrection]
    ) -> Settled:
        check_buckets(corrections)
        keys: list[str] = []
        args: list[ScriptArg] = ["0"]
        if release is not None:
            keys += self.lease_keys(release.pool)
            args = ["1", release.lease_id, self.releases_channel, release.pool]
        for correction in corrections:
            keys.append(self.bucket_key(correction.bucket))
            limit = correction.limit
            args += (correction.delta, limit.capacity, repr(float(limit.period_s)))
        reply = await self._pipeline.run(self._settle, keys, args)
        (released,), states = _parse(reply, 1, len(corrections), "settle.lua")
        return Settled(released=_int(released), buckets=states)

    # --- bindings -----------------------------------------------------------------------------

    async def bind(self, key: str, value: str, ttl_s: float, *, replace: str | None = None) -> str:
        args = (value, max(1, round(ttl_s * 1000)), "0" if replace is None else "1", replace or "")
        return str(await self._pipeline.run(self._bind, (self.binding_key(key),), args))

    async def lookup(self, key: str) -> str | None:
        value = await self._pipeline.call(("GET", self.binding_key(key)), "GET")
        return None if value is None else str(value)

    async def unbind(self, key: str) -> None:
        await self._pipeline.call(("DEL", self.binding_key(key)), "DEL")

    # --- release notices ----------------------------------------------------------------------

    async def watch_releases(self, on_release: Callable[[str], None]) -> None:
        """Subscribe to the releases channel (lease.lua publishes on it) on a connection of its
        own; on a broken connection, subscribe again after a short pause."""
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.releases_channel)
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        on_release(str(message.get("data")))
            except (RedisError, OSError) as exc:
                log.debug("release notices interrupted (%s); subscribing again", exc)
                await asyncio.sleep(RESUBSCRIBE_S)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8

    # --- lifecycle ----------------------------------------------------------------------------

    async def ping(self) -> float:
        started = time.perf_counter()
        async with _translated("PING"):
            await self._redis.ping()
        return time.perf_counter() - started

    async def close(self) -> None:
        await self._pipeline.close()
        await self._redis.aclose()
        await self._pool.aclose()

@asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        raise StateStoreError(f"redis {what}: {type(exc).__name__}: {exc}") from exc


def _parse(
    reply: object, head: int, buckets: int, what: str
) -> tuple[list[object], tuple[BucketState, ...]]:
    """A script's reply: `head` fields of its own, then four per bucket (lib/buckets.lua's
    bucket_reply)."""
    if not isinstance(reply, list) or len(reply) != head + 4 * buckets:
        raise StateStoreError(f"{what} answered {reply!r}")
    fields = reply[head:]
    states = tuple(
        BucketState(
            allowed=bool(fields[i]),
            remaining=remaining_units(float(fields[i + 1])),
            retry_after_s=float(fields[i + 2]) / 1000,
            reset_s=float(fields[i + 3]) / 1000,
        )
        for i in range(0, len(fields), 4)
    )
    return reply[:head], states


def _ms(seconds: float) -> str:
    return repr(seconds * 1000.0)


def _int(reply: object) -> int:
    if not isinstance(reply, int):
        raise StateStoreError(f"redis answered {reply!r}, expected an integer")
    return reply
