"""A StateStore that survives its primary (Redis) going away, as configured.

On StateStoreError from the primary:

* `fail_closed` raises StateStoreUnavailable (HTTP 503): no request is admitted that the shared
  limits have not seen.
* `fail_open` serves from the fallback (an in-memory store): each instance enforces the limits
  locally, so N instances admit up to N times a shared limit until Redis returns.

Either way the decision is logged once when the outage starts and once when it ends (with its
duration), and counted in plain attributes that the metrics module reads at scrape time. While
the primary is down, calls go straight to the failure mode; a background probe pings the primary
every `probe_interval_s` and switches back when it answers, so a dead Redis is not hit (and waited
on) by every request.

Reconciling (fail_open): what the fallback's token buckets let through during an outage is
charged to the shared buckets when the primary answers again (a forced take, at most one
bucket's capacity each: older use would have refilled by now), so an outage does not hand out
a second budget.

Leases taken in the fallback stay there until released: `release` / `renew` / re-acquire of such a
lease go to the fallback even after the primary is back, and while they live their units count
against the primary's limit for the same pool (`held` adds them), so this instance does not
over-admit on recovery.

The composite steps follow the same rules as the calls they combine: a `charge` goes to the
primary with the lease's limit less the fallback's units of that pool, and when served by the
fallback records its lease and bucket use there (a charge that re-acquires a fallback-held
lease is served there whole, and its bucket use reconciled at once when the primary is up); a `settle` whose lease the fallback holds
releases it in the fallback, and its corrections go wherever corrections go now (the primary
when up), so the step is then two calls, one of them local.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar, get_args

from kvgate.errors import StateStoreUnavailable
from kvgate.state.base import (
    BucketCorrection,
    BucketLimit,
    BucketState,
    BucketTake,
    Charged,
    LeaseHold,
    Settled,
    StateStore,
    StateStoreError,
)

FailureMode = Literal["fail_open", "fail_closed"]
T = TypeVar("T")


class ResilientStore:
    def __init__(
        self,
        primary: StateStore,
        fallback: StateStore,
        mode: FailureMode,
        *,
        probe_interval_s: float = 1.0,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in get_args(FailureMode):
            raise ValueError(f"failure mode must be one of {get_args(FailureMode)}, got {mode!r}")
        self.backend = primary.backend
        self.mode = mode
        self.up = True
        self.outages = 0
        self.fallback_calls = 0
        self.errors = 0
        self.last_latency_s = 0.0
        self._primary = primary
        self._fallback = fallback
        self._probe_interval_s = probe_interval_s
        self._log = logger or logging.getLogger("kvgate.state")
        self._clock = clock
        self._past_outages_s = 0.0
        self._down_since = 0.0
        self._fallback_calls_at_outage = 0
        self._probe: asyncio.Task[None] | None = None
        self._fallback_leases: dict[str, set[str]] = {}  # pool -> lease ids held by the fallback
        # bucket -> (units the fallback let through and did not get back, its limit)
        self._unreconciled: dict[str, tuple[int, BucketLimit]] = {}
        self._reconciling: asyncio.Task[None] | None = None
        self.reconciled_units = 0

    @property
    def round_trips(self) -> int:
        """The primary's round trips (pipelines), when it counts them."""
        return int(getattr(self._primary, "round_trips", 0))

    @property
    def calls(self) -> int:
        return int(getattr(self._primary, "calls", 0))

    @property
    def outage_seconds(self) -> float:
        """Total time the primary has been down, the current outage included."""
        current = 0.0 if self.up else self._clock() - self._down_since
        return self._past_outages_s + current

    # --- leases -------------------------------------------------------------------------------

    async def try_acquire(
        self, pool: str, lease_id: str, amount: int, limit: int, ttl_s: float
    ) -> bool:
        if self._in_fallback(pool, lease_id):
            return await self._fallback.try_acquire(pool, lease_id, amount, limit, ttl_s)
        local = await self._fallback_held(pool)

        async def in_fallback() -> bool:
            acquired = await self._fallback.try_acquire(pool, lease_id, amount, limit, ttl_s)
            if acquired:
                self._fallback_leases.setdefault(pool, set()).add(lease_id)
            return acquired

        return await self._call(
            lambda: self._primary.try_acquire(pool, lease_id, amount, limit - local, ttl_s),
            in_fallback,
        )

    async def release(self, pool: str, lease_id: str) -> int:
        if self._in_fallback(pool, lease_id):
            self._forget_fallback_lease(pool, lease_id)
            return await self._fallback.release(pool, lease_id)
        return await self._call(
            lambda: self._primary.release(pool, lease_id),
            lambda: self._fallback.release(pool, lease_id),
        )

    async def renew(self, pool: str, lease_ids: list[str], ttl_s: float) -> int:
        local = [lease_id for lease_id in lease_ids if self._in_fallback(pool, lease_id)]
        remote = [lease_id for lease_id in lease_ids if not self._in_fallback(pool, lease_id)]
        live = await self._fallback.renew(pool, local, ttl_s) if local else 0
        if remote:
            live += await self._call(
                lambda: self._primary.renew(pool, remote, ttl_s),
                lambda: self._fallback.renew(pool, remote, ttl_s),
            )
        return live

    async def held(self, pool: str) -> int:
        local = await self._fallback_held(pool)

        async def shared() -> int:
            return await self._primary.held(pool) + local

        return await self._call(shared, lambda: self._fallback.held(pool))

    def _in_fallback(self, pool: str, lease_id: str) -> bool:
        return lease_id in self._fallback_leases.get(pool, ())

    def _forget_fallback_lease(self, pool: str, lease_id: str) -> None:
        ids = self._fallback_leases[pool]
        ids.discard(lease_id)
        if not ids:
            del self._fallback_leases[pool]

    async def _fallback_held(self, pool: str) -> int:
        """Units of `pool` held by this instance's fallback leases (0 and forgotten once none)."""
        if pool not in self._fallback_leases:
            return 0
        units = await self._fallback.held(pool)
        if units == 0:
            # All released or expired; forget them so the table does not grow.
            del self._fallback_leases[pool]
        return units

    # --- token buckets and bindings -----------------------------------------------------------

    async def take(
        self, bucket: str, amount: int, limit: BucketLimit, *, force: bool = False
    ) -> BucketState:
        async def in_fallback() -> BucketState:
            state = await self._fallback.take(bucket, amount, limit, force=force)
            if state.allowed:
                self._note_local_use(bucket, amount, limit)
            return state

        return await self._call(
            lambda: self._primary.take(bucket, amount, limit, force=force), in_fallback
        )

    async def put_back(self, bucket: str, amount: int, limit: BucketLimit) -> BucketState:
        async def in_fallback() -> BucketState:
            self._note_local_use(bucket, -amount, limit)
            return await self._fallback.put_back(bucket, amount, limit)

        return await self._call(
            lambda: self._primary.put_back(bucket, amount, limit), in_fallback
        )

    def _note_local_use(self, bucket: str, amount: int, limit: BucketLimit) -> None:
        used, _ = self._unreconciled.get(bucket, (0, limit))
        self._unreconciled[bucket] = (max(0, used + amount), limit)

    async def _reconcile(self) -> None:
        """Charge the shared buckets with what the fallback let through during the outage."""
        pending, self._unreconciled = self._unreconciled, {}
        charged = 0
        for bucket, (used, limit) in pending.items():
            units = min(used, limit.capacity)
            if units <= 0:
                continue
            try:
                await self._primary.take(bucket, units, limit, force=True)
            except StateStoreError:
                self._note_local_use(bucket, used, limit)  # next recovery tries again
                continue
            charged += units
        self.reconciled_units += charged
        if charged:
            self._log.warning(
                "state store (%s): charged %d units used locally during the outage to the "
                "shared buckets", self.backend, charged,
            )

    # --- composite steps ----------------------------------------------------------------------

    async def charge(self, lease: LeaseHold | None, takes: Sequence[BucketTake]) -> Charged:
        async def in_fallback() -> Charged:
            charged = await self._fallback.charge(lease, takes)
            if charged.granted:
                if lease is not None:
                    self._fallback_leases.setdefault(lease.pool, set()).add(lease.lease_id)
                for take in takes:
                    self._note_local_use(take.bucket, take.amount, take.limit)
            return charged

        if lease is not None and self._in_fallback(lease.pool, lease.lease_id):
            # Re-acquiring a lease the fallback holds: the whole step stays there, atomic;
            # with the primary up, its bucket use is charged to the shared buckets at once.
            charged = await in_fallback()
            if self.up:
                self._reconcile_soon()
            return charged
        shared = lease
        if lease is not None:
            local = await self._fallback_held(lease.pool)
            shared = dataclasses.replace(lease, limit=lease.limit - local)
        return await self._call(lambda: self._primary.charge(shared, takes), in_fallback)

    async def settle(
        self, release: LeaseHold | None, corrections: Sequence[BucketCorrection]
    ) -> Settled:
        released = 0
        if release is not None and self._in_fallback(release.pool, release.lease_id):
            self._forget_fallback_lease(release.pool, release.lease_id)
            released = (await self._fallback.settle(release, ())).released
            release = None
            if not corrections:
                return Settled(released, ())

        async def in_fallback() -> Settled:
            for correction in corrections:  # a refund undoes local use, an overdraw adds
                self._note_local_use(correction.bucket, -correction.delta, correction.limit)
            return await self._fallback.settle(release, corrections)

        settled = await self._call(
            lambda: self._primary.settle(release, corrections), in_fallback
        )
        return Settled(released + settled.released, settled.buckets)

    async def peek(self, bucket: str, limit: BucketLimit) -> BucketState:
        return await self._call(
            lambda: self._primary.peek(bucket, limit),
            lambda: self._fallback.peek(bucket, limit),
        )

    async def bind(self, key: str, value: str, ttl_s: float, *, replace: str | None = None) -> str:
        return await self._call(
            lambda: self._primary.bind(key, value, ttl_s, replace=replace),
            lambda: self._fallback.bind(key, value, ttl_s, replace=replace),
        )

    async def lookup(self, key: str) -> str | None:
        return await self._call(
            lambda: self._primary.lookup(key), lambda: self._fallback.lookup(key)
        )

    async def unbind(self, key: str) -> None:
        await self._call(lambda: self._primary.unbind(key), lambda: self._fallback.unbind(key))

    # --- lifecycle ----------------------------------------------------------------------------

    async def ping(self) -> float:
        """The primary's round trip; raises StateStoreError while it is down (a real probe)."""
        try:
            rtt = await self._primary.ping()
        except StateStoreError as exc:
            self._went_down(exc)
            raise
        self.last_latency_s = rtt
        self._came_back()
        return rtt

    async def watch_releases(self, on_release: Callable[[str], None]) -> None:
        """The shared store's notices (the local fallback has nothing to announce)."""
        await self._primary.watch_releases(on_release)

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None
        if self._reconciling is not None:
            with contextlib.suppress(asyncio.CancelledError, StateStoreError):
                await self._reconciling
        await self._primary.close()
        await self._fallback.close()

    # --- the failure policy -------------------------------------------------------------------

    async def _call(
        self, primary: Callable[[], Awaitable[T]], fallback: Callable[[], Awaitable[T]]
    ) -> T:
        if self.up:
            started = time.perf_counter()
            try:
                result = await primary()
            except StateStoreError as exc:
                self._went_down(exc)
            else:
                self.last_latency_s = time.perf_counter() - started
                return result
        if self.mode == "fail_closed":
            raise StateStoreUnavailable("the state store is unreachable; try again shortly")
        self.fallback_calls += 1
        return await fallback()

    def _went_down(self, exc: StateStoreError) -> None:
        self.errors += 1
        if not self.up:
            return
        self.up = False
        self.outages += 1
        self._down_since = self._clock()
        self._fallback_calls_at_outage = self.fallback_calls
        consequence = (
            "serving from local in-memory limits (fail_open)"
            if self.mode == "fail_open"
            else "refusing requests with 503 (fail_closed)"
        )
        self._log.warning(
            "state store (%s) is down: %s; %s until it answers again",
            self.backend,
            exc,
            consequence,
        )
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    def _came_back(self) -> None:
        if self.up:
            return
        duration = self._clock() - self._down_since
        self._past_outages_s += duration
        self.up = True
        self._log.warning(
            "state store (%s) is back after %.1f s down (%d calls served by the fallback)",
            self.backend,
            duration,
            self.fallback_calls - self._fallback_calls_at_outage,
        )
        self._reconcile_soon()

    def _reconcile_soon(self) -> None:
        if self._unreconciled and (self._reconciling is None or self._reconciling.done()):
            self._reconciling = asyncio.get_running_loop().create_task(self._reconcile())

    async def _probe_until_up(self) -> None:
        while not self.up:
            await asyncio.sleep(self._probe_interval_s)
            if self.up:
                return
            try:
                rtt = await self._primary.ping()
            except StateStoreError:
                self.errors += 1
                continue
            self.last_latency_s = rtt
            self._came_back()
