"""The in-memory StateStore: one kvgate instance's state, with an injectable clock.

Used when kvgate runs alone (`state.backend: memory`) and as the local fallback when Redis is
down and the failure mode is fail_open. Same semantics as the Redis store (the contract suite in
tests/state/test_contract.py runs against both); the bucket arithmetic here is mirrored by
kvgate/state/lua/bucket.lua.

Concurrency: asyncio-safe because no method awaits inside its critical section (the methods are
`async` only to match the Protocol). Not thread-safe.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvgate.state.base import (
    BucketCorrection,
    BucketLimit,
    BucketState,
    BucketTake,
    Charged,
    LeaseHold,
    Settled,
)

# Expired bindings and full buckets are dropped in a sweep once the table has doubled since the
# last one, so the tables stay proportional to what is live (sessions come and go).
_MIN_SWEEP_SIZE = 1024
# Session bindings live ttl_s (30 min by default) and every new conversation, `user` or
# X-Session-Id makes one: without a bound, one client inventing keys grows the process by
# ~250 bytes a request for half an hour. Beyond this many, the least recently bound goes.
MAX_BINDINGS = 100_000


@dataclass(slots=True)
class _Lease:
    amount: int
    expires_at: float


class _Pool:
    """One pool's leases with their running total and an expiry heap, so acquiring, releasing
    and expiring cost O(log n) in the leases held, not a scan of them all (a scan grows with
    concurrency)."""

    __slots__ = ("expiries", "held", "leases")

    def __init__(self) -> None:
        self.leases: dict[str, _Lease] = {}
        self.held = 0  # the sum of the live leases' amounts
        # (expires_at, lease id); an entry whose lease was renewed, replaced or released since
        # no longer matches it and is skipped when it comes up
        self.expiries: list[tuple[float, str]] = []

    def expire(self, now: float) -> None:
        expiries, leases = self.expiries, self.leases
        while expiries and expiries[0][0] <= now:
            expires_at, lease_id = heapq.heappop(expiries)
            lease = leases.get(lease_id)
            if lease is not None and lease.expires_at == expires_at:
                del leases[lease_id]
                self.held -= lease.amount

    def put(self, lease_id: str, amount: int, expires_at: float) -> None:
        old = self.leases.get(lease_id)
        self.held += amount - (old.amount if old is not None else 0)
        self.leases[lease_id] = _Lease(amount, expires_at)
        heapq.heappush(self.expiries, (expires_at, lease_id))

    def pop(self, lease_id: str) -> int:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return 0
        self.held -= lease.amount
        return lease.amount

    def renew(self, lease_id: str, expires_at: float) -> bool:
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        lease.expires_at = expires_at
        heapq.heappush(self.expiries, (expires_at, lease_id))
        return True


@dataclass(slots=True)
class _Bucket:
    """A token bucket's level (may be negative: debt) as of `updated_at`, under `limit`."""

    level: float
    updated_at: float
    limit: BucketLimit

    def refill(self, now: float, limit: BucketLimit) -> None:
        """Bring the level up to `now`; a changed limit applies from here on."""
        self.level = self.level_at(now, limit)
        self.updated_at = now
        self.limit = limit

    def level_at(self, now: float, limit: BucketLimit) -> float:
        elapsed = max(0.0, now - self.updated_at)
        return min(float(limit.capacity), self.level + elapsed * limit.rate_per_s)

    def state(self, allowed: bool, retry_after_s: float, limit: BucketLimit) -> BucketState:
        return BucketState(
            allowed=allowed,
            remaining=remaining_units(self.level),
            retry_after_s=retry_after_s,
            reset_s=(limit.capacity - self.level) / limit.rate_per_s,
        )

    def wait_for(self, amount: int, limit: BucketLimit) -> float:
        """Seconds until `amount` would fit; more than the whole capacity never fits, so
        then the time to a full bucket."""
        return max(0.0, (min(amount, limit.capacity) - self.level) / limit.rate_per_s)


def remaining_units(level: float) -> int:
    """Whole units left; the epsilon keeps float refill error from costing a unit."""
    return math.floor(level + 1e-9)


def check_limit(limit: BucketLimit) -> None:
    if limit.capacity <= 0 or limit.period_s <= 0:
        raise ValueError(f"a bucket needs capacity > 0 and period_s > 0, got {limit}")


def check_buckets(steps: Iterable[BucketTake | BucketCorrection]) -> None:
    """A composite step's buckets: valid limits, each bucket once."""
    names: set[str] = set()
    for step in steps:
        check_limit(step.limit)
        if step.bucket in names:
            raise ValueError(f"bucket {step.bucket!r} appears twice in one step")
        names.add(step.bucket)


class MemoryStore:
    backend = "memory"

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, max_bindings: int = MAX_BINDINGS
    ) -> None:
        self._clock = clock
        self.max_bindings = max_bindings
        self._pools: dict[str, _Pool] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._bindings: dict[str, tuple[str, float]] = {}
        self._sweep_buckets_at = _MIN_SWEEP_SIZE
        self._sweep_bindings_at = _MIN_SWEEP_SIZE

    @property
    def kept_bindings(self) -> int:
        """Session bindings in memory, expired ones not swept yet included."""
        return len(self._bindings)

    @property
    def kept_buckets(self) -> int:
        """Token buckets in memory, full ones not swept yet included."""
        return len(self._buckets)

    # --- leases -------------------------------------------------------------------------------

    def _live_pool(self, pool: str, now: float) -> _Pool | None:
        leases = self._pools.get(pool)
        if leases is None:
            return None
        leases.expire(now)
        if not leases.leases:
            del self._pools[pool]
            return None
        return leases

    def _lease_fits(self, pool: str, lease_id: str, amount: int, limit: int, now: float) -> bool:
        leases = self._live_pool(pool, now)
        if leases is None:
            return amount <= limit
        current = leases.leases.get(lease_id)
        return leases.held - (current.amount if current is not None else 0) + amount <= limit

    def _hold(self, pool: str, lease_id: str, amount: int, expires_at: float) -> None:
        leases = self._pools.get(pool)
        if leases is None:
            leases = self._pools[pool] = _Pool()
        leases.put(lease_id, amount, expires_at)

    def _release(self, pool: str, lease_id: str) -> int:
        leases = self._live_pool(pool, self._clock())
        if leases is None:
            return 0
        amount = leases.pop(lease_id)
        if not leases.leases:
            del self._pools[pool]
        return amount

    async def try_acquire(
        self, pool: str, lease_id: str, amount: int, limit: int, ttl_s: float
    ) -> bool:
        now = self._clock()
        if not self._lease_fits(pool, lease_id, amount, limit, now):
            return False
        self._hold(pool, lease_id, amount, now + ttl_s)
        return True

    async def release(self, pool: str, lease_id: str) -> int:
        return self._release(pool, lease_id)

    async def renew(self, pool: str, lease_ids: list[str], ttl_s: float) -> int:
        now = self._clock()
        leases = self._live_pool(pool, now)
        if leases is None:
            return 0
        return sum(leases.renew(lease_id, now + ttl_s) for lease_id in lease_ids)

    async def held(self, pool: str) -> int:
        leases = self._live_pool(pool, self._clock())
        return 0 if leases is None else leases.held

    # --- token buckets ------------------------------------------------------------------------

    def _bucket(self, bucket: str, limit: BucketLimit) -> _Bucket:
        check_limit(limit)
        now = self._clock()
        state = self._buckets.get(bucket)
        if state is None:
            if len(self._buckets) >= self._sweep_buckets_at:
                self._sweep_buckets(now)
            state = self._buckets[bucket] = _Bucket(float(limit.capacity), now, limit)
        state.refill(now, limit)
        return state

    def _sweep_buckets(self, now: float) -> None:
        # A full bucket is the same as a missing one.
        full = [
            name
            for name, b in self._buckets.items()
            if b.level_at(now, b.limit) >= b.limit.capacity
        ]
        for name in full:
            del self._buckets[name]
        self._sweep_buckets_at = max(_MIN_SWEEP_SIZE, 2 * len(self._buckets))

    async def take(
        self, bucket: str, amount: int, limit: BucketLimit, *, force: bool = False
    ) -> BucketState:
        state = self._bucket(bucket, limit)
        if force or amount <= state.level:
            state.level -= amount
            return state.state(True, 0.0, limit)
        return state.state(False, state.wait_for(amount, limit), limit)

    async def put_back(self, bucket: str, amount: int, limit: BucketLimit) -> BucketState:
        return self._correct(BucketCorrection(bucket, amount, limit))

    def _correct(self, correction: BucketCorrection) -> BucketState:
        """Put back a refund (capped at the capacity) or take an overdraw by force."""
        limit = correction.limit
        state = self._bucket(correction.bucket, limit)
        state.level = min(float(limit.capacity), state.level + correction.delta)
        return state.state(True, 0.0, limit)

    async def peek(self, bucket: str, limit: BucketLimit) -> BucketState:
        """What `take(bucket, 1, limit)` would answer, without taking."""
        check_limit(limit)
        existing = self._buckets.get(bucket)
        now = self._clock()
        level = existing.level_at(now, limit) if existing else float(limit.capacity)
        state = _Bucket(level, now, limit)
        if state.level >= 1:
            return state.state(True, 0.0, limit)
        return state.state(False, (1 - state.level) / limit.rate_per_s, limit)

    # --- composite steps ----------------------------------------------------------------------

    async def charge(self, lease: LeaseHold | None, takes: Sequence[BucketTake]) -> Charged:
        check_buckets(takes)
        now = self._clock()
        lease_fits = lease is None or self._lease_fits(
            lease.pool, lease.lease_id, lease.amount, lease.limit, now
        )
        buckets = [(self._bucket(take.bucket, take.limit), take) for take in takes]
        fits = [take.amount <= bucket.level for bucket, take in buckets]
        if lease_fits and all(fits):
            if lease is not None:
                self._hold(lease.pool, lease.lease_id, lease.amount, now + lease.ttl_s)
            for bucket, take in buckets:
                bucket.level -= take.amount
        return Charged(lease_fits, tuple(
            bucket.state(True, 0.0, take.limit) if fit
            else bucket.state(False, bucket.wait_for(take.amount, take.limit), take.limit)
            for (bucket, take), fit in zip(buckets, fits, strict=True)
        ))  # fmt: skip

    async def settle(
        self, release: LeaseHold | None, corrections: Sequence[BucketCorrection]
    ) -> Settled:
        check_buckets(corrections)
        released = 0 if release is None else self._release(release.pool, release.lease_id)
        return Settled(released, tuple(self._correct(c) for c in corrections))

    # --- bindings -----------------------------------------------------------------------------

    async def bind(self, key: str, value: str, ttl_s: float, *, replace: str | None = None) -> str:
        now = self._clock()
        current = self._live_binding(key, now)
        if current is None or current == value or (replace is not None and current == replace):
            if current is None and len(self._bindings) >= self._sweep_bindings_at:
                self._sweep_bindings(now)
            self._bindings.pop(key, None)  # re-inserted last: the order is recency of binding
            while len(self._bindings) >= self.max_bindings:
                del self._bindings[next(iter(self._bindings))]
            self._bindings[key] = (value, now + ttl_s)
            return value
        return current

    async def lookup(self, key: str) -> str | None:
        return self._live_binding(key, self._clock())

    async def unbind(self, key: str) -> None:
        self._bindings.pop(key, None)

    def _live_binding(self, key: str, now: float) -> str | None:
        entry = self._bindings.get(key)
        if entry is None:
            return None
        value, expires_at = entry
        if expires_at <= now:
            del self._bindings[key]
            return None
        return value

    def _sweep_bindings(self, now: float) -> None:
        expired = [key for key, (_, expires_at) in self._bindings.items() if expires_at <= now]
        for key in expired:
            del self._bindings[key]
        self._sweep_bindings_at = max(_MIN_SWEEP_SIZE, 2 * len(self._bindings))

    # --- lifecycle ----------------------------------------------------------------------------

    async def watch_releases(self, on_release: Callable[[str], None]) -> None:
        await asyncio.Event().wait()  # one instance: its own releases wake it directly

    async def ping(self) -> float:
        return 0.0

    async def close(self) -> None:
        return None
