"""Admission on KV blocks: whether a request may run on a replica now, and the fair queue
for those that may not yet.

A request is admitted onto a replica only if the blocks kvgate has reserved there (by every
instance sharing the store) plus this request's reservation stay within `target_utilization`
× the replica's `num_gpu_blocks` (scaled by the replica's overcommit factor in predicted
mode). The router ranks the replicas; admission takes the first of the ranking whose ledger
(`kvgate.ledger`) has room. Otherwise the request waits in its pool's `FairQueue` within its
class's wait budget — ranked again on every attempt — or is refused with 429 and an honest
`Retry-After`; a request whose worst case cannot fit on any replica of its pool even when
empty gets 400 at once.

`Admission.admit` is an async context manager: leaving it — completion, error, disconnect,
cancellation, even a second cancellation arriving during the release — releases the request's
blocks and its share of its prefix exactly once (`kvgate.protect.finish`).

Queue order: a request that does not fit yet holds back lower classes on the replicas it
could use, and everyone there once it has used half its wait budget, so large requests still
make progress; otherwise smaller requests pass it. What a request needs and holds (`Demand`,
`Slot`) lives in `kvgate.demand`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

from kvgate.backpressure import Backpressure
from kvgate.config import AdmissionConfig, Config, CurrentConfig
from kvgate.demand import Demand, Slot
from kvgate.errors import NeverFits, NoReplica, RateLimited
from kvgate.leases import LeaseKeeper
from kvgate.ledger import Ledger
from kvgate.metrics import Metrics
from kvgate.overcommit import Overcommit
from kvgate.protect import finish
from kvgate.queue import Ticket
from kvgate.replicas import Replica
from kvgate.routing.fleet import Fleet, ReplicaView, take_snapshot
from kvgate.routing.router import Ranking
from kvgate.state.base import StateStore
from kvgate.waiting import AGING_SHARE, PoolQueue, Waiter

log = logging.getLogger(__name__)

# While requests wait, look at the shared ledger at least this often. Releases wake the queue
# at once (this instance's directly, other instances' through the store's release notices);
# the poll catches what nobody announces, such as a dead instance's leases expiring.
POLL_INTERVAL_S = 0.1

# Ranks the replicas for one request, given the seconds it has waited so far; called on arrival
# and again on every placement attempt, so a queued request goes where room appears.
Ranker = Callable[[float], Awaitable[Ranking]]


class Admission:
    """A request is admitted under its own config's `admission` section (`admit`'s `config`),
    queued requests included. What every request shares follows the config in force now
    (`current`): the depth of a pool's queue, and the scrapes' age limit for the overcommit
    feedback after each discovery round."""

    def __init__(
        self, store: StateStore, metrics: Metrics, current: CurrentConfig, keeper: LeaseKeeper
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.current = current
        self.keeper = keeper
        self._pools: dict[str, PoolQueue] = {}
        self.ledger = Ledger(store, keeper, metrics)
        self.reserved = self.ledger.reserved  # this instance's view of every replica's ledger
        self.prefixes = self.ledger.prefixes
        self.overcommit = Overcommit()
        self.backpressure = Backpressure()  # replicas whose vLLM refused ours as busy

    def snapshot(
        self,
        replicas: Iterable[Replica],
        config: Config,
        circuit: Callable[[str], str] = lambda _: "closed",
    ) -> Fleet:
        """The replicas as they stand now, with this ledger's figures, under `config`."""
        return take_snapshot(
            replicas,
            config=config.admission,
            stale_after_s=config.discovery.stale_after_s,
            reserved=self.reserved,
            shared_prefix_blocks=self.prefixes.held_blocks,
            circuit=circuit,
            overcommit=self.overcommit.factor,
            typical_blocks=self.p95_worst_case,
            busy=self.backpressure.busy,
        )

    def in_order(self, replicas: Sequence[Replica]) -> Ranker:
        """A ranker that tries `replicas` in the order given, each as it is at the attempt
        (for callers that have chosen already, and tests)."""

        async def rank(waited_s: float) -> Ranking:
            return Ranking(list(self.snapshot(replicas, self.current())))

        return rank

    def _pool(self, name: str) -> PoolQueue:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = PoolQueue()
        return pool

    @contextlib.asynccontextmanager
    async def admit(
        self, demand: Demand, rank: Ranker, config: AdmissionConfig, since: float | None = None
    ) -> AsyncIterator[Slot]:
        """Reserve the demand on the first replica of its ranking with room, now or from the
        queue (ranked again on every attempt), under `config` (the request's own). `since`:
        when the request first asked (a replica refused it as busy since): its wait budget
        runs from then."""
        asked = time.monotonic()
        started = asked if since is None else since
        ranking = await rank(asked - started)
        candidates = [v.replica for v in ranking.replicas]
        if not config.enabled:  # a plain proxy: the first candidate not busy, nothing reserved
            if not candidates:
                raise NoReplica(f"no healthy replica in pool {demand.pool!r} serves this model")
            yield Slot(self._not_busy(demand, ranking), "", 0, released=True)
            return
        self._check_can_ever_fit(demand, ranking.replicas, config)
        pool = self._pool(demand.pool)
        pool.reservations.append(max(demand.blocks_on(r) for r in candidates))
        # replicas that requests queued ahead of this one are waiting for are theirs first;
        # any other may take it now (no head-of-line blocking across replicas)
        waited_for = frozenset(
            replica.id for ahead in pool.ahead_of(demand, candidates)
            for replica in ahead.payload.candidates
        )
        slot = await self._try_place(
            demand, ranking, config, time.monotonic() - started, waited_for
        )
        if slot is None:
            slot = await self._wait(pool, demand, rank, ranking, config, started, asked - started)
        self.metrics.admissions.labels(
            demand.pool, slot.replica.id, "yes" if slot.queued else "no"
        ).inc()
        self.metrics.worst_case_blocks.labels(demand.pool).observe(
            demand.worst_blocks_on(slot.replica)
        )
        if demand.predicted:
            self.ledger.growing.add(slot)
        try:
            yield slot
        finally:
            await self._release(pool, slot)

    def _not_busy(self, demand: Demand, ranking: Ranking) -> Replica:
        """Without admission, the first replica that is not busy; 429 when all of them are."""
        for view in ranking.replicas:
            if not view.busy:
                return view.replica
        retry_after = min(self.backpressure.lapses_in(v.id) for v in ranking.replicas)
        raise RateLimited(
            f"every replica in pool {demand.pool!r} is busy (vLLM's queue limits)",
            code="replicas_busy", retry_after_s=retry_after,
        )

    def refused_busy(self, slot: Slot, reason: str, config: AdmissionConfig) -> None:
        """The replica's vLLM refused this slot's request as busy (`reason`: vLLM's): it takes
        no more from this instance than it holds without it, until one ends or the backoff."""
        self.backpressure.refused(slot.replica.id, config.busy_backoff_s)
        self.metrics.replica_rejections.labels(slot.replica.id, reason).inc()

    def _check_can_ever_fit(
        self, demand: Demand, candidates: Sequence[ReplicaView], config: AdmissionConfig
    ) -> None:
        if not candidates:
            raise NoReplica(f"no healthy replica in pool {demand.pool!r} can take this request")
        known = [(v.replica, v.admissible_blocks) for v in candidates if v.admissible_blocks is not None]
        if not known:
            raise NoReplica(
                f"no replica in pool {demand.pool!r} has a known KV capacity yet; retry shortly"
            )
        if all(demand.worst_blocks_on(r) > n for r, n in known):
            best = max(known, key=lambda rn: rn[1])
            raise NeverFits(
                f"this request's worst case is {demand.worst_tokens} tokens = "
                f"{demand.worst_blocks_on(best[0])} KV blocks, but the largest replica in pool "
                f"{demand.pool!r} admits at most {best[1]} blocks "
                f"({config.target_utilization:g} × {best[0].num_gpu_blocks}); "
                "reduce max_tokens or the prompt",
                param="max_tokens",
            )

    async def _try_place(
        self,
        demand: Demand,
        ranking: Ranking,
        config: AdmissionConfig,
        waited_s: float,
        closed: frozenset[str] = frozenset(),
    ) -> Slot | None:
        """The first replica of the ranking (not `closed` to this request) whose ledger takes
        the demand; while the request has waited less than the ranking's hold, only its
        session's replica."""
        for view in ranking.usable(waited_s):
            limit = view.limit(demand.predicted)
            if view.id in closed or limit is None or demand.blocks_on(view.replica) > limit:
                continue
            if (view.waiting or 0) > config.max_replica_waiting:
                continue
            slot = await self.ledger.reserve(
                view.replica, demand, limit, config.lease_ttl_s,
                on_stale=lambda stale: self._release(self._pool(demand.pool), stale),
            )
            if slot is not None:
                self.backpressure.placed(view.id)
                slot.queued_s = waited_s
                return slot
        return None

    async def _wait(
        self,
        pool: PoolQueue,
        demand: Demand,
        rank: Ranker,
        ranking: Ranking,
        config: AdmissionConfig,
        started: float,
        waited_s: float = 0.0,
    ) -> Slot:
        """Queue the demand until the dispatcher places it, within its class's wait budget
        less the `waited_s` it spent before a busy replica sent it back. One that could not
        start within that at the recent rate of releases is refused at once: waiting it out
        would only miss its latency target later."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Slot] = loop.create_future()
        waiter = Waiter(demand, rank, future, ranking, started, config)
        ticket = Ticket(demand.tenant, demand.priority, started, waiter)
        # the queue is every request's: its depth is the one in force now
        max_depth = self.current().admission.queue.max_depth
        refused = pool.queue.push(ticket, max_depth)
        if refused is ticket:
            raise self._queue_full_error(demand.pool, max_depth, config)
        if refused is not None:
            shed: Waiter = refused.payload
            if not shed.future.done():
                shed.future.set_exception(
                    self._queue_full_error(demand.pool, max_depth, shed.config)
                )
        budget = config.queue.budget(demand.priority)
        left = budget - waited_s  # what a busy replica that sent it back left of it
        expected = self.expected_wait(pool, ticket, config)
        if expected is not None and expected > left:
            pool.queue.remove(ticket)
            raise RateLimited(
                f"no KV capacity in pool {demand.pool!r} within this request's wait budget "
                f"of {budget:g}s (about {expected:.1f}s at the recent rate)",
                code="wait_budget_exceeded", retry_after_s=expected,
            )
        self._observe_depth(demand.pool, pool)
        pool.wake.set()
        try:
            async with asyncio.timeout(left):
                return await asyncio.shield(future)
        except BaseException as exc:
            # Leaving without the slot (timeout, disconnect, shed): if the dispatcher placed
            # us meanwhile, give the blocks back; otherwise make sure it never will.
            if future.done() and not future.cancelled() and future.exception() is None:
                await self._release(pool, future.result())
            else:
                future.cancel()
            if isinstance(exc, TimeoutError):
                raise RateLimited(
                    f"no KV capacity in pool {demand.pool!r} within {budget:g}s",
                    code="queue_timeout",
                    retry_after_s=self.retry_after(demand.pool, len(pool.queue), config),
                ) from None
            raise
        finally:
            pool.queue.remove(ticket)
            self._observe_depth(demand.pool, pool)
            self.metrics.queue_wait.labels(demand.pool, demand.priority).observe(
                time.monotonic() - started
            )

    def expected_wait(self, pool: PoolQueue, ticket: Ticket, config: AdmissionConfig) -> float | None:
        """Seconds until this request and those that start before it could all run, at the
        rate the pool has freed blocks over the last FREED_WINDOW_S; None when they may fit
        now or that rate is unknown."""
        waiter: Waiter = ticket.payload
        demand, candidates = waiter.demand, waiter.candidates
        free = 0
        for view in waiter.ranking.replicas:
            limit = view.limit(demand.predicted)
            if limit is not None:
                free += max(0, limit - self.reserved.get(view.id, 0))
        needed = min((demand.blocks_on(r) for r in candidates), default=0)
        now = time.monotonic()
        budget = config.queue.budget(demand.priority)
        for queued in pool.ahead_of(demand, candidates, ticket, free, budget, now):
            ahead: Waiter = queued.payload
            needed += min((ahead.demand.blocks_on(r) for r in ahead.candidates), default=0)
        if needed <= free:
            return None  # it may start now: let the dispatcher try
        rate = pool.freed_per_s(now)
        if not rate:
            return None
        return min(config.queue.max_wait_s, (needed - free) / rate)

    async def dispatch(self, pool_name: str) -> None:
        """Serve one pool's queue in fair order until cancelled (one task per pool)."""
        pool = self._pool(pool_name)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_INTERVAL_S if len(pool.queue) else None):
                    await pool.wake.wait()
            pool.wake.clear()
            await self._serve_pass(pool)

    async def _serve_pass(self, pool: PoolQueue) -> None:
        """One pass over the queue in service order, each request ranked afresh and placed
        under the admission config it arrived with. A request that does not fit puts up a
        barrier on the replicas it could use: requests of a lower class may not take them, nor
        may anyone once it has used AGING_SHARE of its wait budget (so large requests still
        make progress). Requests for other replicas go on. Within a pass, once a request of n
        blocks did not fit on a set of replicas, larger ones for the same set are not tried."""
        now = time.monotonic()
        barriers: list[tuple[int, bool, frozenset[str]]] = []  # (rank, aged, replica ids)
        refused: dict[tuple[frozenset[str], bool], int] = {}
        for ticket in list(pool.queue):
            waiter: Waiter = ticket.payload
            demand, future, config = waiter.demand, waiter.future, waiter.config
            if future.done():
                pool.queue.remove(ticket)
                continue
            try:
                waited = now - ticket.enqueued_at
                waiter.ranking = await waiter.rank(waited)
                closed = frozenset(
                    rid for rank, aged, ids in barriers if aged or rank < ticket.rank for rid in ids
                )
                # during a session's hold, only its replica: the barrier it puts up, and what
                # smaller requests may not try after it, concern that replica alone
                usable = [v for v in waiter.ranking.usable(waited) if v.id not in closed]
                if not usable:
                    continue
                ids = frozenset(v.id for v in usable)
                need = min(demand.blocks_on(v.replica) for v in usable)
                smallest = refused.get((ids, demand.predicted))
                if smallest is not None and need >= smallest:
                    continue
                slot = await self._try_place(
                    demand, waiter.ranking, config, now - ticket.enqueued_at, closed
                )
            except Exception as exc:  # a store failure ends this waiter, not the loop
                if not future.done():
                    future.set_exception(exc)
                pool.queue.remove(ticket)
                continue
            if slot is None:
                refused[(ids, demand.predicted)] = min(need, smallest or need)
                aged = now - ticket.enqueued_at > AGING_SHARE * config.queue.budget(ticket.priority)
                barriers.append((ticket.rank, aged, ids))
                continue
            pool.queue.serve(ticket)
            slot.queued = True
            if future.done():  # the waiter left while we were placing it
                await self._release(pool, slot)
            else:
                future.set_result(slot)

    def after_discovery(self, replicas: Iterable[Replica]) -> None:
        """A discovery round brought fresh scrapes: steer each replica's overcommit by them,
        then let the queues try again."""
        stale = self.current().discovery.stale_after_s
        waiting = {name for name, pool in self._pools.items() if len(pool.queue)}
        for replica in replicas:
            scrape = replica.fresh_scrape(stale)
            if scrape is None:
                continue
            factor = self.overcommit.observe(
                replica.id, preemptions=scrape.preemptions, kv_usage=scrape.kv_usage,
                demand=replica.pool in waiting, waiting=scrape.waiting,
                rejections=scrape.admission_rejections,
            )
            self.metrics.overcommit.labels(replica.id, replica.pool).set(factor)
        self.wake_all()

    def wake_all(self) -> None:
        for pool in self._pools.values():
            pool.wake.set()

    def pools(self) -> list[str]:
        return list(self._pools)

    async def _release(self, pool: PoolQueue, slot: Slot) -> None:
        """Give back everything the slot holds — its lease, then its share of the prefix — as
        one unit that no cancellation can cut short."""
        if slot.released:
            return
        slot.released = True  # mark first: release exactly once
        self.backpressure.released(slot.replica.id)
        await finish(self._give_back(pool, slot))

    async def _give_back(self, pool: PoolQueue, slot: Slot) -> None:
        now = time.monotonic()
        pool.releases.append(now)
        pool.freed.append((now, slot.reserved_blocks))
        try:
            await self.ledger.give_back(slot)
        finally:
            pool.wake.set()

    def retry_after(self, pool_name: str, ahead: int, config: AdmissionConfig) -> float:
        """Seconds until `ahead + 1` requests' worth of capacity frees, at the recent rate."""
        return self._pool(pool_name).retry_after(ahead, config.queue.max_wait_s)

    def p95_worst_case(self, pool_name: str) -> int | None:
        return self._pool(pool_name).p95_reservation()

    def _queue_full_error(
        self, pool_name: str, max_depth: int, config: AdmissionConfig
    ) -> RateLimited:
        depth = len(self._pool(pool_name).queue)
        return RateLimited(
            f"the queue for pool {pool_name!r} is full ({max_depth} waiting)",
            code="queue_full",
            retry_after_s=self.retry_after(pool_name, depth, config),
        )

    def _observe_depth(self, pool_name: str, pool: PoolQueue) -> None:
        for priority in ("critical", "standard", "sheddable"):
            self.metrics.queue_depth.labels(pool_name, priority).set(pool.queue.depth(priority))

