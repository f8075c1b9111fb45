"""Keeping this instance's leases alive, and catching the ones that were never given back.

Every hold kvgate takes in the state store — a request's blocks on a replica's ledger, a
shared prefix's blocks, a tenant's concurrency slot — is a lease with a TTL, renewed here
every ttl/3 while its request runs; if this instance dies its leases expire and the capacity
returns by itself. The TTL is `admission.lease_ttl_s` of the config in force: a reload that
shortens it is followed within `kvgate.intervals.RECHECK_S`, so no lease outlives its TTL
waiting for a renewal timed by the old one.

While this instance lives, a lease it forgets to give back would be renewed forever. So a
lease added with `max_age_s` (how long its request may run at most, from its timeouts) that
is still here after that long is logged as a leak, counted, and dropped: its `on_stale`
callback releases it as the request would have. Shared-prefix leases have no age of their
own: they live while requests use them, and a dropped request lets go of its share.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvgate.config import CurrentConfig
from kvgate.errors import KvgateError
from kvgate.intervals import Sleep, pause
from kvgate.protect import finish
from kvgate.state.base import StateStore, StateStoreError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Held:
    since: float
    max_age_s: float | None
    on_stale: Callable[[], Awaitable[object]] | None
    kind: str


class LeaseKeeper:
    """Renews the leases this instance holds, every ttl/3, until they are released.

    The TTL can change with a reload while leases live. Renewals use the TTL in force; the wait
    before the next round is a third of the shortest TTL any live lease may still have: the
    one of the last round, or a shorter one a lease was taken with since (a request queued
    before the reload acquires with its own config's). So a longer TTL takes effect one round
    later, and no lease outlives its last renewal by waiting on the new, longer interval.

    `clock` dates the leases (for `max_age_s`) and, with `sleep`, times the rounds of `run`.
    """

    def __init__(
        self,
        store: StateStore,
        current: CurrentConfig,
        *,
        on_dropped: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.store = store
        self.current = current
        self._on_dropped = on_dropped  # called with the lease's kind ("ledger", "concurrency")
        self._clock = clock
        self._sleep = sleep
        self._live: dict[str, dict[str, _Held]] = {}
        self._shortest_ttl_s = math.inf  # the shortest TTL a live lease may have now

    @property
    def ttl_s(self) -> float:
        """The leases' TTL in force now."""
        return self.current().admission.lease_ttl_s

    def add(
        self,
        pool: str,
        lease_id: str,
        *,
        max_age_s: float | None = None,
        on_stale: Callable[[], Awaitable[object]] | None = None,
        kind: str | None = None,
        ttl_s: float | None = None,
    ) -> None:
        """`kind` names the lease in the dropped-leases metric; by default the pool name's
        first word (`ledger:<replica>` → ledger). `ttl_s`: what the lease was taken with (by
        default the TTL in force)."""
        held = _Held(self._clock(), max_age_s, on_stale, kind or pool.partition(":")[0])
        self._live.setdefault(pool, {})[lease_id] = held
        self._shortest_ttl_s = min(self._shortest_ttl_s, self.ttl_s if ttl_s is None else ttl_s)

    def interval_s(self) -> float:
        """The wait before the next round of renewals."""
        return min(self.ttl_s, self._shortest_ttl_s) / 3

    def discard(self, pool: str, lease_id: str) -> None:
        leases = self._live.get(pool)
        if leases is not None:
            leases.pop(lease_id, None)
            if not leases:
                del self._live[pool]

    def live_leases(self) -> int:
        return sum(len(leases) for leases in self._live.values())

    async def run(self) -> None:
        while True:
            await pause(self.interval_s, clock=self._clock, sleep=self._sleep)
            await self.drop_stale()
            await self.renew_all()

    async def renew_all(self) -> None:
        ttl_s = self.ttl_s
        before, self._shortest_ttl_s = self._shortest_ttl_s, ttl_s  # leases added meanwhile lower it
        for pool, leases in list(self._live.items()):
            try:
                await self.store.renew(pool, list(leases), ttl_s)
            except (StateStoreError, KvgateError) as exc:
                self._shortest_ttl_s = min(self._shortest_ttl_s, before)  # not renewed
                # The next round retries; if the store stays away, the leases expire and
                # other instances may admit onto this capacity: say so.
                log.warning("could not renew %d leases on %s: %s", len(leases), pool, exc)

    async def drop_stale(self) -> int:
        """Release every lease held longer than its request may run; returns how many."""
        now = self._clock()
        stale = [
            (pool, lease_id, held)
            for pool, leases in self._live.items()
            for lease_id, held in leases.items()
            if held.max_age_s is not None and now - held.since > held.max_age_s
        ]
        for pool, lease_id, held in stale:
            log.error(
                "lease %s on %s was held %.0fs, longer than its request may run (%gs): "
                "dropped as leaked", lease_id, pool, now - held.since, held.max_age_s,
            )
            self.discard(pool, lease_id)
            if self._on_dropped is not None:
                self._on_dropped(held.kind)
            try:
                if held.on_stale is not None:
                    await finish(held.on_stale())
                else:
                    await finish(self.store.release(pool, lease_id))
            except (StateStoreError, KvgateError) as exc:
                log.warning("could not release stale lease %s on %s (expires by TTL): %s",
                            lease_id, pool, exc)
        return len(stale)
