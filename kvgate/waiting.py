"""A pool's queue of requests waiting for KV capacity, and what it knows about waiting.

Beside the fair order itself (`kvgate.queue.FairQueue`, pure), each pool keeps how fast it
has been giving blocks back — for `Retry-After` and for refusing early a request that could
not start within its wait budget — and which queued requests a newcomer may not pass.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgate.config import PRIORITY_CLASSES
from kvgate.queue import FairQueue, Ticket

if TYPE_CHECKING:
    from kvgate.config import AdmissionConfig
    from kvgate.demand import Demand, Slot
    from kvgate.replicas import Replica
    from kvgate.routing.router import Ranking

# A waiter that has used this share of its wait budget is not passed by smaller requests.
AGING_SHARE = 0.5
# The rate a pool frees blocks at, for early refusals, is measured over this window.
FREED_WINDOW_S = 10.0


@dataclass(eq=False, slots=True)
class Waiter:
    """A queued request: what it needs, how to rank replicas for it, where its slot goes, its
    latest ranking (for estimates between attempts), and the admission config it arrived
    under (the dispatcher places it by that one, whatever a reload does meanwhile)."""

    demand: Demand
    rank: Callable[[float], Awaitable[Ranking]]
    future: asyncio.Future[Slot]
    ranking: Ranking
    since: float  # when it arrived (monotonic)
    config: AdmissionConfig

    @property
    def candidates(self) -> list[Replica]:
        """The replicas it may take now (during a session's hold, that one alone)."""
        usable = self.ranking.usable(time.monotonic() - self.since)
        return [view.replica for view in usable]


@dataclass(slots=True)
class PoolQueue:
    queue: FairQueue = field(default_factory=FairQueue)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    releases: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    freed: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=128))
    reservations: deque[int] = field(default_factory=lambda: deque(maxlen=512))

    def freed_per_s(self, now: float) -> float | None:
        """Blocks given back per second over the last FREED_WINDOW_S; None while fewer than
        four releases fall in it (a quiet pool says nothing about how fast it would free)."""
        recent = [(t, b) for t, b in self.freed if now - t <= FREED_WINDOW_S]
        if len(recent) < 4:
            return None
        span = max(now - recent[0][0], 0.1)
        return sum(b for _, b in recent) / span

    def retry_after(self, ahead: int, max_wait_s: float) -> float:
        """Seconds until `ahead + 1` requests' worth of capacity frees, at the recent rate."""
        if len(self.releases) >= 2:
            span = max(1e-3, time.monotonic() - self.releases[0])
            rate = len(self.releases) / span
            return min(max(1.0, (ahead + 1) / rate), max(1.0, max_wait_s))
        return max(1.0, min(max_wait_s, 5.0))

    def p95_reservation(self) -> int | None:
        """The 95th percentile of the blocks recent requests reserved on arrival."""
        cases = sorted(self.reservations)
        return cases[min(len(cases) - 1, int(0.95 * len(cases)))] if cases else None

    def ahead_of(
        self,
        demand: Demand,
        candidates: Sequence[Replica],
        upto: Ticket | None = None,
        room: int | None = None,
        budget: float = 0.0,
        now: float = 0.0,
    ) -> list[Ticket]:
        """The queued requests, ahead in service order (up to `upto`), that want one of these
        replicas and will start before this demand: every one of a better class; of its own
        class, those that fit in `room` or have used AGING_SHARE of `budget` (a larger one
        that does not fit yet is passed)."""
        if not len(self.queue):  # the usual case: nobody waits
            return []
        rank = PRIORITY_CLASSES.index(demand.priority)
        ids = {r.id for r in candidates}
        ahead = []
        for queued in self.queue:
            if queued is upto:
                break
            waiter: Waiter = queued.payload
            queued_demand, queued_candidates = waiter.demand, waiter.candidates
            if waiter.future.done() or queued.rank > rank:
                continue
            if not any(r.id in ids for r in queued_candidates):
                continue
            if queued.rank == rank and room is not None:
                need = min((queued_demand.blocks_on(r) for r in queued_candidates), default=0)
                aged = now - queued.enqueued_at > AGING_SHARE * budget
                if need > room and not aged:
                    continue
            ahead.append(queued)
        return ahead
