"""The Redis StateStore: state shared by every kvgate instance on one Redis.

Each operation is one Lua script (kvgate/state/lua/), so N instances enforce one limit with no
read-then-write race, and the scripts read Redis's own clock (`TIME`) for expiry and refill, so
instances with skewed clocks agree. Scripts are called by SHA and loaded again when Redis answers
NOSCRIPT (after a restart or SCRIPT FLUSH).

Keys carry the configured prefix and a Redis Cluster hash tag per pool / bucket / binding
(`{prefix:pool}:leases`, `{prefix:pool}:amounts`, `{prefix:pool}:held`), so a script's keys
share one slot.

Timeouts are short (connect, read and waiting for a pooled connection), with one immediate retry
on a fresh connection after a connection error, so a connection left stale by a Redis restart
costs nothing; a dead Redis
raises StateStoreError within a few timeouts instead of hanging a request. Every Redis failure
becomes StateStoreError. The connection pool reconnects by itself when Redis comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from importlib import resources

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from kvgate.state.base import BucketLimit, BucketState, StateStoreError
from kvgate.state.memory import check_limit, remaining_units

ScriptArg = str | int | float
log = logging.getLogger(__name__)
RESUBSCRIBE_S = 0.5


class _Script:
    """A Lua script from kvgate/state/lua, run by SHA (EVALSHA), loaded again on NOSCRIPT."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = resources.files("kvgate.state").joinpath(f"lua/{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def __call__(
        self, client: Redis, keys: Sequence[str], args: Sequence[ScriptArg]
    ) -> object:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


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
        self._lease = _Script("lease")
        self._bucket = _Script("bucket")
        self._bind = _Script("bind")

    # --- keys (one hash tag per pool / bucket / binding) -------------------------------------

    def lease_keys(self, pool: str) -> tuple[str, str, str]:
        tag = f"{{{self.key_prefix}:{pool}}}"
        return f"{tag}:leases", f"{tag}:amounts", f"{tag}:held"

    @property
    def releases_channel(self) -> str:
        return f"{self.key_prefix}:released"

    def bucket_key(self, bucket: str) -> str:
        return f"{{{self.key_prefix}:{bucket}}}:bucket"

    def binding_key(self, key: str) -> str:
        return f"{{{self.key_prefix}:{key}}}:binding"

    # --- leases -------------------------------------------------------------------------------

    async def try_acquire(
        self, pool: str, lease_id: str, amount: int, limit: int, ttl_s: float
    ) -> bool:
        args = ("acquire", lease_id, amount, limit, _ms(ttl_s))
        return bool(await self._run(self._lease, self.lease_keys(pool), args))

    async def release(self, pool: str, lease_id: str) -> int:
        args = ("release", lease_id, self.releases_channel, pool)
        return _int(await self._run(self._lease, self.lease_keys(pool), args))

    async def renew(self, pool: str, lease_ids: list[str], ttl_s: float) -> int:
        if not lease_ids:
            return 0
        args = ("renew", _ms(ttl_s), *lease_ids)
        return _int(await self._run(self._lease, self.lease_keys(pool), args))

    async def held(self, pool: str) -> int:
        return _int(await self._run(self._lease, self.lease_keys(pool), ("held",)))

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
        reply = await self._run(self._bucket, (self.bucket_key(bucket),), args)
        if not isinstance(reply, list) or len(reply) != 4:
            raise StateStoreError(f"bucket.lua answered {reply!r}")
        allowed, level, retry_ms, reset_ms = reply
        return BucketState(
            allowed=bool(allowed),
            remaining=remaining_units(float(level)),
            retry_after_s=float(retry_ms) / 1000,
            reset_s=float(reset_ms) / 1000,
        )

    # --- bindings -----------------------------------------------------------------------------

    async def bind(self, key: str, value: str, ttl_s: float, *, replace: str | None = None) -> str:
        args = (value, max(1, round(ttl_s * 1000)), "0" if replace is None else "1", replace or "")
        return str(await self._run(self._bind, (self.binding_key(key),), args))

    async def lookup(self, key: str) -> str | None:
        async with _translated("GET"):
            value = await self._redis.get(self.binding_key(key))
        return None if value is None else str(value)

    async def unbind(self, key: str) -> None:
        async with _translated("DEL"):
            await self._redis.delete(self.binding_key(key))

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
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    # --- lifecycle ----------------------------------------------------------------------------

    async def ping(self) -> float:
        started = time.perf_counter()
        async with _translated("PING"):
            await self._redis.ping()
        return time.perf_counter() - started

    async def close(self) -> None:
        await self._redis.aclose()
        await self._pool.aclose()

    async def _run(self, script: _Script, keys: Sequence[str], args: Sequence[ScriptArg]) -> object:
        async with _translated(f"{script.name}.lua"):
            return await script(self._redis, keys, args)


@asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        raise StateStoreError(f"redis {what}: {type(exc).__name__}: {exc}") from exc


def _ms(seconds: float) -> str:
    return repr(seconds * 1000.0)


def _int(reply: object) -> int:
    if not isinstance(reply, int):
        raise StateStoreError(f"redis answered {reply!r}, expected an integer")
    return reply
