"""A pool's queue of requests waiting for KV capacity, and what it knows about waiting.

Beside the fair order itself (`kvgate.admission.queue.FairQueue`, pure), each pool keeps what its
recent requests did — how long they held their blocks, how fast each class took room, how much
later than estimated they started — and one estimate of when room frees (`time_to_room`), for
`Retry-After` and for refusing at arrival a request that could not start within its latency
target; and which queued requests a newcomer may not pass.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgate.admission.queue import FairQueue, Ticket
from kvgate.config import PRIORITY_CLASSES
from kvgate.errors import RateLimited
from kvgate.fleet.snapshot import TypicalSizes

if TYPE_CHECKING:
    from kvgate.admission.demand import Demand, Slot
    from kvgate.config import AdmissionConfig
    from kvgate.fleet.replicas import Replica
    from kvgate.routing.ranking import Ranking

# A waiter that has used this share of its wait budget is not passed by smaller requests.
AGING_SHARE = 0.5
# How fast the better classes take room, for a request's expected wait, is measured over this.
CLAIMED_WINDOW_S = 10.0
# How late requests start against their estimate is learned from at least this many of the
# last LATENESS_WINDOW_S (older ones expire: if every request is refused for a while, nothing
# new is learned, and what was learned must not refuse them forever).
LATENESS_MIN_SAMPLES = 8
LATENESS_WINDOW_S = 30.0
# Estimates of at least this long are scaled by how long such estimates really took
# (`PoolQueue.corrected_wait`); shorter ones are mostly the time a request ahead takes to end.
SCALED_FROM_S = 1.0
# A serving pass trusts a queued request's last ranking this long to tell that it cannot be
# placed (a smaller one was just refused where it would ask): within it, a replica that came
# up meanwhile waits for the next ranking.
RERANK_S = 0.5


def time_to_room(
    short: float, reserved: int, backlog: float, running: float, hold_s: float
) -> float:
    """Seconds until a replica could take a request that needs `short` blocks more than it
    has free, while its vLLM holds `backlog` requests more than admission lets it queue: by
    Little's law a replica holding `reserved` blocks frees reserved / hold_s of them a second,
    and one running `running` requests starts running / hold_s new ones. Infinite when
    nothing held there will free the blocks."""
    blocks = 0.0 if short <= 0 else (hold_s * short / reserved if reserved else math.inf)
    queue = 0.0 if backlog <= 0 else hold_s * backlog / max(1.0, running)
    return max(blocks, queue)


@dataclass(eq=False, slots=True)
class Waiter:
    """A queued request: what it needs, how to rank replicas for it, where its slot goes, its
    latest ranking and when it was made (for estimates, and for the serving pass to tell
    without ranking again that it cannot be placed yet), the admission config it arrived under
    (the dispatcher places it by that one, whatever a reload does meanwhile), and its latency
    target (None: it has none)."""

    demand: Demand
    rank: Callable[[float], Awaitable[Ranking]]
    future: asyncio.Future[Slot]
    ranking: Ranking
    since: float  # when it arrived (monotonic)
    config: AdmissionConfig
    target_s: float | None = None
    expected_s: float | None = None  # the wait estimated when it queued (None: unknown)
    # since when a replica it may use has had room for it while it was held back for fair
    # order (None: never yet)
    room_since: float | None = None
    clock: Callable[[], float] = time.monotonic  # the one `since` was read on
    ranked_at: float = -math.inf  # when `ranking` was made, on `clock`
    # what `asks` last answered, for which ranking, and whether its hold was on then
    _asked: tuple[Ranking, bool, Wants | None] | None = field(default=None, repr=False)

    def aged(self, enqueued_at: float, now: float) -> bool:
        """Nothing passes it any more: it has waited AGING_SHARE of its target, and can still
        make it; or AGING_SHARE of max_wait_s, as a request without a target (or one that has
        missed it: holding everyone back for it would only make others miss theirs)."""
        waited, target = now - enqueued_at, self.target_s
        if target is not None and AGING_SHARE * target < waited <= target:
            return True
        return self.overdue(enqueued_at, now)

    def overdue(self, enqueued_at: float, now: float) -> bool:
        """It has waited AGING_SHARE of max_wait_s: it goes before every younger request,
        whatever their class, so that a higher class that keeps arriving cannot make it
        wait out max_wait_s (docs/admission.md, "Class order")."""
        return now - enqueued_at > AGING_SHARE * self.config.queue.max_wait_s

    def wants(self, waited_s: float, closed: frozenset[str]) -> Wants | None:
        """What its latest ranking lets it ask for after `waited_s`, less the `closed`
        replicas; None when that leaves none."""
        usable = [v for v in self.ranking.usable(waited_s) if v.id not in closed]
        if not usable:
            return None
        need = min(self.demand.blocks_on(v.replica) for v in usable)
        return Wants(frozenset(v.id for v in usable), need)

    def asks(self) -> Wants | None:
        """`wants` now, nothing closed: what every newcomer's estimate reads of each request
        queued ahead of it, so it is kept until the ranking changes or its hold ends."""
        waited, ranking = self.clock() - self.since, self.ranking
        held = ranking.hold is not None and waited < ranking.hold.for_s
        asked = self._asked
        if asked is not None and asked[0] is ranking and asked[1] == held:
            return asked[2]
        wants = self.wants(waited, frozenset())
        self._asked = (ranking, held, wants)
        return wants


@dataclass(frozen=True, slots=True)
class Wants:
    """The replicas a queued request may take now, and the fewest blocks it needs on one."""

    ids: frozenset[str]
    need: int


class PassBook:
    """What one serving pass has learned so far: the barriers its requests put up (replicas
    closed to the classes below theirs; to everyone, once one has aged), and, per set of
    replicas and mode, the smallest request refused there."""

    __slots__ = ("_aged", "_by_rank", "_refused")

    def __init__(self) -> None:
        self._by_rank: list[set[str]] = [set() for _ in PRIORITY_CLASSES]
        self._aged: set[str] = set()
        self._refused: dict[tuple[frozenset[str], bool], int] = {}

    def closed_to(self, rank: int) -> frozenset[str]:
        """The replicas a request of class `rank` may not take in what is left of the pass."""
        return frozenset(self._aged.union(*self._by_rank[:rank]))

    def passes_over(self, wants: Wants | None, predicted: bool) -> bool:
        """Whether a request is not tried: nothing it may use is open to it, or one no larger
        (on the same mode) was refused on the same replicas in this pass."""
        if wants is None:
            return True
        smallest = self._refused.get((wants.ids, predicted))
        return smallest is not None and wants.need >= smallest

    def passed_over(self, aged: bool, wants: Wants | None) -> None:
        """A request not tried still holds back everyone once it has aged (a smaller one
        refused before it holds back only the classes below its own)."""
        if aged and wants is not None:
            self._aged.update(wants.ids)

    def refused(self, rank: int, aged: bool, wants: Wants, predicted: bool) -> None:
        key = (wants.ids, predicted)
        self._refused[key] = min(wants.need, self._refused.get(key, wants.need))
        (self._aged if aged else self._by_rank[rank]).update(wants.ids)


class RecentSizes:
    """The last `keep` sizes recorded, kept sorted as well, so that their 95th percentile is
    read in constant time (every request's fleet snapshot reads it)."""

    __slots__ = ("_order", "_sorted")

    def __init__(self, keep: int = 512) -> None:
        self._order: deque[int] = deque(maxlen=keep)
        self._sorted: list[int] = []

    def add(self, size: int) -> None:
        if len(self._order) == self._order.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._order[0])]
        self._order.append(size)
        bisect.insort(self._sorted, size)

    def p95(self) -> int | None:
        cases = self._sorted
        return cases[min(len(cases) - 1, int(0.95 * len(cases)))] if cases else None


@dataclass(slots=True)
class PoolQueue:
    queue: FairQueue = field(default_factory=FairQueue)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # (blocks, seconds held) of the requests that ended here lately
    holds: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=32))
    # (when, class rank, blocks) of the requests placed here lately
    placed: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=1024))
    # (when, seconds later than estimated) of recent requests with a target, as they started
    # (when, expected, waited) of the requests placed from the queue lately
    late: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=64))
    # the blocks recent requests reserved on arrival, on predicted demand (those that were
    # predicted), and their worst cases (all of them): the sizes headroom is counted in
    predicted_sizes: RecentSizes = field(default_factory=RecentSizes)
    worst_sizes: RecentSizes = field(default_factory=RecentSizes)
    # a request found no room on arrival since the last discovery round (it queued, or was
    # refused at once): demand the queue's depth alone would not show
    wanted_room: bool = False

    def take_demand(self) -> bool:
        """Whether requests wanted room here since the last call: some wait now, or one found
        none on arrival (refused at once, it never showed in the queue)."""
        wanted, self.wanted_room = self.wanted_room, False
        return wanted or len(self.queue) > 0

    def released(self, blocks: int, held_s: float | None, now: float) -> None:
        """A request gave its blocks back; `held_s`: how long it held them (None: it was
        placed but never ran, so it says nothing about how long requests hold)."""
        if held_s is not None:
            self.holds.append((blocks, held_s))

    def started(self, expected_s: float, waited_s: float, now: float) -> None:
        """A request estimated to wait `expected_s` was placed after `waited_s`."""
        self.late.append((now, expected_s, waited_s))

    def corrected_wait(self, estimate_s: float, now: float) -> float:
        """`estimate_s` corrected by how the pool's recent estimates came out (none with
        fewer than LATENESS_MIN_SAMPLES in the last LATENESS_WINDOW_S): scaled down, where
        it is SCALED_FROM_S or more, by the median of actual over expected among such
        estimates (never up: a wait that grows with load is what the lateness is for); then
        the lateness added, the 75th percentile of how much later than estimated requests
        started (never below 0). What the estimate leaves out — reservations that grow,
        classes admitted on other limits, holds that lengthen or shorten with load — is
        learned from what happened instead."""
        recent = [(e, w) for t, e, w in self.late if now - t <= LATENESS_WINDOW_S]
        if len(recent) < LATENESS_MIN_SAMPLES:
            return estimate_s
        scale = 1.0
        long = sorted(w / e for e, w in recent if e >= SCALED_FROM_S)
        if estimate_s >= SCALED_FROM_S and len(long) >= LATENESS_MIN_SAMPLES:
            scale = min(1.0, long[len(long) // 2])
        errors = sorted(w - e for e, w in recent)
        return estimate_s * scale + max(0.0, errors[int(0.75 * (len(errors) - 1))])

    def took(self, priority: str, blocks: int, now: float) -> None:
        """A request of class `priority` was placed, with `blocks` reserved."""
        self.placed.append((now, PRIORITY_CLASSES.index(priority), blocks))

    def claimed_per_s(self, priority: str, now: float) -> float:
        """Blocks a second that requests of a better class than `priority` have been placed
        with lately: room they will take as it frees, before a request of this class."""
        rank = PRIORITY_CLASSES.index(priority)
        claimed = sum(b for t, r, b in self.placed if r < rank and now - t <= CLAIMED_WINDOW_S)
        return claimed / CLAIMED_WINDOW_S

    def hold_s(self) -> float | None:
        """How long a reserved block stays reserved, over the recent requests (each weighed
        by its blocks); None until one has ended. By Little's law, a replica holding R blocks
        frees about R / hold_s() of them a second."""
        blocks = sum(b for b, _ in self.holds)
        if not blocks:
            return None
        return sum(b * s for b, s in self.holds) / blocks

    def retry_after(self, ahead: int, reserved: int, max_wait_s: float) -> float:
        """Seconds until `ahead + 1` requests' worth of blocks free where `reserved` blocks are
        held (`time_to_room`, at the recent requests' hold and size), from 1 s to max_wait_s;
        5 s (at most max_wait_s) until a request has ended here."""
        hold = self.hold_s()
        if hold is None or not reserved:
            return max(1.0, min(max_wait_s, 5.0))
        size = sum(b for b, _ in self.holds) / len(self.holds)
        wait = time_to_room((ahead + 1) * size, reserved, 0, 0, hold)
        return min(max(1.0, wait), max(1.0, max_wait_s))

    def arrived(self, demand: Demand, candidates: Sequence[Replica]) -> None:
        """Record the sizes of a request as it asks for admission (on the largest block size
        among the replicas it may take)."""
        self.worst_sizes.add(max(demand.worst_blocks_on(r) for r in candidates))
        if demand.predicted:
            self.predicted_sizes.add(max(demand.blocks_on(r) for r in candidates))

    def typical_sizes(self) -> TypicalSizes:
        """The 95th percentile of recent requests' sizes, per basis."""
        return TypicalSizes(self.predicted_sizes.p95(), self.worst_sizes.p95())

    def ahead_of(
        self,
        demand: Demand,
        ids: Collection[str],
        upto: Ticket | None = None,
        room: int | None = None,
        now: float | None = None,
    ) -> Iterator[Wants]:
        """What each queued request asks for that is ahead in service order (up to `upto`),
        wants one of the replicas `ids` and will start before this demand: every one of a
        better class, and of a worse one those overdue; of its own class, with `room` given,
        all but those it can pass — one that needs more than `room` and has not aged (one no
        larger gets the room first, as it frees)."""
        if not len(self.queue):  # the usual case: nobody waits
            return
        rank = PRIORITY_CLASSES.index(demand.priority)
        for queued in self.queue:
            if queued is upto:
                return
            waiter: Waiter = queued.payload
            if waiter.future.done():
                continue
            if now is None:
                now = waiter.clock()
            if queued.rank > rank and not waiter.overdue(queued.enqueued_at, now):
                continue
            wants = waiter.asks()
            if wants is None or wants.ids.isdisjoint(ids):
                continue
            passable = queued.rank == rank and room is not None and wants.need > room
            if passable and not waiter.aged(queued.enqueued_at, now):
                continue
            yield wants

    def waited_for(self, demand: Demand, ids: frozenset[str]) -> frozenset[str]:
        """Of the replicas `ids`, those that requests queued ahead of this demand wait for:
        theirs first (no head-of-line blocking across the others)."""
        waited: set[str] = set()
        for wants in self.ahead_of(demand, ids):
            waited |= wants.ids & ids
            if len(waited) == len(ids):  # all of them: nothing more to learn
                break
        return frozenset(waited)

    def expected_wait(
        self, ticket: Ticket, config: AdmissionConfig, ledger: Mapping[str, int], now: float
    ) -> float | None:
        """Seconds until this queued request could start on one of the replicas it may use,
        after those that start before it: 0 when it may start now; None when nothing says
        how fast room frees (no request has ended in the pool yet).

        It needs its blocks on one replica: free blocks spread over several do not add up.
        Those ahead take their blocks where blocks free, in proportion to what each replica
        holds, and so do the better classes' requests that will arrive meanwhile, at the rate
        they have lately; how fast blocks free: `time_to_room` (Little's law, on the shared
        ledger, so every instance's requests count), and on a replica held back for its long
        vLLM queue, also how long that queue takes to come down. `ledger`: the blocks
        reserved on each replica, by every instance."""
        waiter: Waiter = ticket.payload
        demand = waiter.demand
        options = [
            (view, limit) for view in waiter.ranking.usable(math.inf)
            if (limit := demand.limit_on(view)) is not None
        ]
        if not options:
            return None
        reserved = [ledger.get(view.id, 0) for view, _ in options]
        room = [max(0, limit - held) for (_, limit), held in zip(options, reserved, strict=True)]
        ids = frozenset(view.id for view, _ in options)
        # those it can pass need more than the free room, and more than it needs itself
        passable = max(sum(room), min(demand.blocks_on(view.replica) for view, _ in options))
        ahead = sum(wants.need for wants in self.ahead_of(demand, ids, ticket, passable, now))
        total = sum(reserved)
        hold = self.hold_s()
        if hold is not None and total:
            # the share of the freeing rate (total / hold) left after the better classes
            left = 1 - self.claimed_per_s(demand.priority, now) * hold / total
            hold = hold / left if left > 0 else math.inf
        waits = []
        for (view, _), held, free in zip(options, reserved, room, strict=True):
            share = ahead * held / total if total else ahead / len(options)
            short = demand.blocks_on(view.replica) - free + share
            backlog = 0 if demand.first_in_vllm else (
                (view.waiting or 0) - config.max_replica_waiting)
            if short <= 0 and backlog <= 0:
                return 0.0
            if hold is not None:
                waits.append(time_to_room(short, held, backlog, view.running or 0, hold))
        return min(waits) if waits else None

    def refuse_if_late(
        self, ticket: Ticket, ledger: Mapping[str, int], now: float, waited_s: float
    ) -> None:
        """Refuse the queued request at once (429 wait_budget_exceeded) if it is expected to
        start later than its latency target, or than max_wait_s (without a target, or with
        a longer one: it would time out anyway), less the `waited_s` already spent: the
        estimate (`expected_wait`), corrected by how recent ones came out (`corrected_wait`)."""
        waiter: Waiter = ticket.payload
        estimate = self.expected_wait(ticket, waiter.config, ledger, now)
        if estimate is None:
            return
        waiter.expected_s = estimate
        expected = self.corrected_wait(estimate, now)
        max_wait, target = waiter.config.queue.max_wait_s, waiter.target_s
        limit = max_wait if target is None else min(target, max_wait)
        if expected <= limit - waited_s:
            return
        self.queue.remove(ticket)
        within = (f"this request's latency target of {target:g}s" if limit == target
                  else f"max_wait_s of {max_wait:g}s")
        when = f"about {expected:.1f}s" if expected < max_wait else f"over {max_wait:g}s"
        raise RateLimited(
            f"no KV capacity in pool {waiter.demand.pool!r} within {within} "
            f"(expected wait: {when})",
            code="wait_budget_exceeded", retry_after_s=min(expected, max_wait),
        )
