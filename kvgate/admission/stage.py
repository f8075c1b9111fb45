"""Admission on KV blocks: whether a request may run on a replica now, and the fair queue
for those that may not yet.

A request is admitted onto a replica only if the blocks kvgate has reserved there (by every
instance sharing the store) plus this request's reservation stay within `target_utilization`
× the replica's `num_gpu_blocks` (scaled by the replica's overcommit factor in predicted
mode). The router ranks the replicas; admission takes the first of the ranking whose ledger
(`kvgate.admission.ledger`) has room. Otherwise the request waits in its pool's `FairQueue` — ranked
again on every attempt — up to `max_wait_s`. Refusals come at arrival, each with an honest
`Retry-After`: a full queue; where a latency target is set (`ttft_target_s`, per class or
tenant: opt-in), a request that could not start within it; and a request whose worst case
cannot fit on any replica of its pool even when empty (400). The only refusal after waiting
is `max_wait_s` running out.

`Admission.admit` is an async context manager: leaving it — completion, error, disconnect,
cancellation, even a second cancellation arriving during the release — releases the request's
blocks and its share of its prefix exactly once (`kvgate.protect.finish`).

Queue order: a request that does not fit yet holds back lower classes on the replicas it
could use, and everyone there once it has aged (`Waiter.aged`: half its target, or half
max_wait_s), so large requests still make progress; otherwise smaller requests pass it. One
that has waited half of max_wait_s (`Waiter.overdue`) goes before every younger request,
whatever their class: a higher class that keeps arriving cannot starve a lower one. Where
a request may go: `kvgate.admission.placement`; what it needs and holds: `.demand`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

from kvgate.admission.backpressure import Backpressure
from kvgate.admission.demand import Demand, Slot
from kvgate.admission.leases import LeaseKeeper
from kvgate.admission.ledger import Ledger
from kvgate.admission.overcommit import Overcommit
from kvgate.admission.placement import Placer, check_can_ever_fit, first_not_busy
from kvgate.admission.queue import Ticket
from kvgate.admission.room import Room
from kvgate.admission.waiting import RERANK_S, PassBook, PoolQueue, Waiter
from kvgate.config import AdmissionConfig, CurrentConfig
from kvgate.errors import NoReplica, RateLimited
from kvgate.fleet.drain import set_drain
from kvgate.fleet.replicas import Replica
from kvgate.fleet.snapshot import TypicalSizes
from kvgate.metrics import Metrics
from kvgate.protect import finish
from kvgate.routing.ranking import Ranking
from kvgate.state.base import StateStore

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
        self,
        store: StateStore,
        metrics: Metrics,
        current: CurrentConfig,
        keeper: LeaseKeeper,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: what queue waits, ageing and the pools' recent rates are read on (the one
        `admit`'s `since` comes from)."""
        self.clock = clock
        self.store = store
        self.metrics = metrics
        self.current = current
        self.keeper = keeper
        self._pools: dict[str, PoolQueue] = {}
        self.ledger = Ledger(store, keeper, metrics)
        self.reserved = self.ledger.reserved  # this instance's view of every replica's ledger
        self.exact = self.ledger.exact  # of those, this instance's worst-case reservations
        self.lower = self.ledger.lower  # of those, the classes below critical
        self.prefixes = self.ledger.prefixes
        self.overcommit = Overcommit()
        self.backpressure = Backpressure()  # replicas whose vLLM refused ours as busy
        self.room = Room(self.ledger, self.overcommit, clock)  # work conservation
        self.placer = Placer(
            self.ledger, self.room, self.backpressure, metrics,
            on_stale=lambda demand, slot: self._release(self.pool(demand.pool), slot),
        )

    # What the fleet view shows of admission (`kvgate.fleet.view.AdmissionFigures`).

    def shared_prefix_blocks(self, replica_id: str) -> int:
        return self.prefixes.held_blocks(replica_id)

    def overcommit_factor(self, replica_id: str) -> float:
        return self.overcommit.factor(replica_id)

    def busy(self, replica_id: str) -> bool:
        return self.backpressure.busy(replica_id)

    def typical_sizes(self, pool: str) -> TypicalSizes:
        return self.pool(pool).typical_sizes()

    def pool(self, name: str) -> PoolQueue:
        """The pool's queue and what it has learned of its requests (made on first use)."""
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = PoolQueue()
        return pool

    @contextlib.asynccontextmanager
    async def admit(
        self,
        demand: Demand,
        rank: Ranker,
        config: AdmissionConfig,
        since: float | None = None,
        tenant_target_s: float | None = None,
    ) -> AsyncIterator[Slot]:
        """Reserve the demand on the first replica of its ranking with room, now or from the
        queue (ranked again on every attempt), under `config` (the request's own). `since`:
        when the request first asked (a replica refused it as busy since): its wait runs from
        then. `tenant_target_s`: its tenant's latency target, over its class's."""
        asked = self.clock()
        started = asked if since is None else since
        ranking = await rank(asked - started)
        candidates = [v.replica for v in ranking.replicas]
        if not config.enabled:  # a plain proxy: the first candidate not busy, nothing reserved
            if not candidates:
                raise NoReplica(f"no healthy replica in pool {demand.pool!r} serves this model")
            yield Slot(first_not_busy(demand, ranking, self.backpressure), "", 0, released=True)
            return
        check_can_ever_fit(demand, ranking.replicas, config)
        pool = self.pool(demand.pool)
        pool.arrived(demand, candidates)
        # replicas that requests queued ahead of this one are waiting for are theirs first;
        # any other may take it now (no head-of-line blocking across replicas)
        waited_for = pool.waited_for(demand, frozenset(r.id for r in candidates))
        target = config.queue.target(demand.priority, tenant_target_s)
        conserve = target is None  # work conservation: for requests without a target
        slot = await self.placer.place(
            demand, ranking, config, self.clock() - started, waited_for, conserve=conserve
        )
        if slot is None:
            pool.wanted_room = True
            future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
            waiter = Waiter(
                demand, rank, future, ranking, started, config, target, clock=self.clock,
                ranked_at=asked,
            )
            if waited_for and self.placer.fits(demand, ranking, config, waited_for, conserve):
                waiter.room_since = self.clock()  # held back for those queued ahead
            slot = await self._wait(pool, waiter, asked - started)
        self.metrics.admissions.labels(
            demand.pool, slot.replica.id, "yes" if slot.queued else "no"
        ).inc()
        self.metrics.worst_case_blocks.labels(demand.pool).observe(
            demand.worst_blocks_on(slot.replica)
        )
        if demand.predicted:
            self.ledger.growing.add(slot)
        placed = self.clock()
        pool.took(demand.priority, slot.reserved_blocks, placed)
        try:
            yield slot
        finally:
            await self._release(pool, slot, held_s=self.clock() - placed)

    def refused_busy(self, slot: Slot, reason: str, config: AdmissionConfig) -> None:
        """The replica's vLLM refused this slot's request as busy (`reason`: vLLM's): it takes
        no more from this instance than it holds without it, until one ends or the backoff."""
        self.backpressure.refused(slot.replica.id, config.busy_backoff_s)
        self.metrics.replica_rejections.labels(slot.replica.id, reason).inc()

    async def _wait(self, pool: PoolQueue, waiter: Waiter, waited_s: float = 0.0) -> Slot:
        """Queue the request until the dispatcher places it, up to max_wait_s less the
        `waited_s` it spent before a busy replica sent it back. With a latency target, one
        that could not start within what is left of it is refused now, with the expected wait
        as Retry-After: waiting it out would only miss the target later."""
        demand, config, future = waiter.demand, waiter.config, waiter.future
        ticket = Ticket(demand.tenant, demand.priority, waiter.since, waiter)
        # the queue is every request's: its depth is the one in force now
        max_depth = self.current().admission.queue.max_depth
        refused = pool.queue.push(ticket, max_depth)
        if refused is ticket:
            raise self._queue_full_error(demand.pool, max_depth, waiter)
        if refused is not None:
            shed: Waiter = refused.payload
            if not shed.future.done():
                shed.future.set_exception(
                    self._queue_full_error(demand.pool, max_depth, shed)
                )
        # refused now if it would miss its target, or time out anyway
        pool.refuse_if_late(ticket, self.reserved, self.clock(), waited_s)
        self._observe_depth(demand.pool, pool)
        pool.wake.set()
        max_wait = config.queue.max_wait_s
        try:
            async with asyncio.timeout(max_wait - waited_s):
                slot = await asyncio.shield(future)
            if waiter.expected_s is not None:  # how far off the estimate was
                now = self.clock()
                waited = now - waiter.since - waited_s
                pool.started(waiter.expected_s, waited, now)
                self.metrics.wait_estimate_error.labels(demand.pool, demand.priority).observe(
                    waited - waiter.expected_s
                )
            return slot
        except BaseException as exc:
            # Leaving without the slot (timeout, disconnect, shed): if the dispatcher placed
            # us meanwhile, give the blocks back; otherwise make sure it never will.
            if future.done() and not future.cancelled() and future.exception() is None:
                await self._release(pool, future.result())
            else:
                future.cancel()
            if isinstance(exc, TimeoutError):
                raise RateLimited(
                    f"no KV capacity in pool {demand.pool!r} within {max_wait:g}s",
                    code="queue_timeout",
                    retry_after_s=self.retry_after(pool, len(pool.queue), waiter),
                ) from None
            raise
        finally:
            pool.queue.remove(ticket)
            self._observe_depth(demand.pool, pool)
            now = self.clock()
            self.metrics.queue_wait.labels(demand.pool, demand.priority).observe(
                now - waiter.since
            )
            with_room = 0.0 if waiter.room_since is None else now - waiter.room_since
            self.metrics.queue_wait_with_room.labels(demand.pool, demand.priority).observe(
                with_room
            )

    async def dispatch(self, pool_name: str) -> None:
        """Serve one pool's queue in fair order until cancelled (one task per pool)."""
        pool = self.pool(pool_name)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_INTERVAL_S if len(pool.queue) else None):
                    await pool.wake.wait()
            pool.wake.clear()
            await self._serve_pass(pool)

    async def _serve_pass(self, pool: PoolQueue) -> None:
        """One pass over the queue in service order, the overdue first (`Waiter.overdue`),
        each request placed under the admission config it arrived with. A request that does
        not fit puts up a barrier on the replicas it could use: requests of a lower class may
        not take them, nor may anyone once it has aged (`Waiter.aged`), so large requests
        still make progress. Requests for other
        replicas go on. Within a pass, once a request of n blocks did not fit on a set of
        replicas, larger ones for the same set are not tried, nor ranked again while their
        last ranking is younger than RERANK_S: passes run on every release, and a pass over a
        deep queue ranks the requests it may place, not every one."""
        now = self.clock()
        book = PassBook()
        tickets = list(pool.queue)
        # the overdue first, whatever their class: no class starves another past max_wait_s
        tickets.sort(key=lambda t: not t.payload.overdue(t.enqueued_at, now))
        for ticket in tickets:
            waiter: Waiter = ticket.payload
            demand, future, config = waiter.demand, waiter.future, waiter.config
            if future.done():
                pool.queue.remove(ticket)
                continue
            waited = now - ticket.enqueued_at
            closed = book.closed_to(ticket.rank)
            aged = waiter.aged(ticket.enqueued_at, now)
            conserve = waiter.target_s is None
            if closed and waiter.room_since is None and self.placer.fits(
                demand, waiter.ranking, config, closed, conserve
            ):
                waiter.room_since = now  # held back for fair order while it would fit
            # its last ranking is trusted a while, unless it left it no replica at all (every
            # one busy then): a busy mark may lapse within it, and the request would wait on
            if now - waiter.ranked_at < RERANK_S and waiter.ranking.usable(waited):
                wants = waiter.wants(waited, closed)
                if book.passes_over(wants, demand.predicted):
                    book.passed_over(aged, wants)
                    continue
            try:
                waiter.ranking, waiter.ranked_at = await waiter.rank(waited), now
                wants = waiter.wants(waited, closed)
                if book.passes_over(wants, demand.predicted):
                    book.passed_over(aged, wants)
                    continue
                slot = await self.placer.place(
                    demand, waiter.ranking, config, waited, closed, conserve=conserve
                )
            except Exception as exc:  # a store failure ends this waiter, not the loop
                if not future.done():
                    future.set_exception(exc)
                pool.queue.remove(ticket)
                continue
            if slot is None:
                assert wants is not None  # passes_over(None) holds
                book.refused(ticket.rank, aged, wants, demand.predicted)
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
        waiting = {name for name, pool in self._pools.items() if pool.take_demand()}
        for replica, factor in self.room.discovered(list(replicas), stale, waiting):
            self.metrics.overcommit.labels(replica.id, replica.pool).set(factor)
        self.wake_all()

    async def drain(self, replica: Replica, draining: bool) -> None:
        """Drain (or undrain) `replica`, here and on every instance; the waiting look again."""
        await set_drain(self.store, replica, draining)
        self.wake_all()

    def wake_all(self) -> None:
        for pool in self._pools.values():
            pool.wake.set()

    def pools(self) -> list[str]:
        return list(self._pools)

    async def _release(self, pool: PoolQueue, slot: Slot, held_s: float | None = None) -> None:
        """Give back everything the slot holds — its lease, then its share of the prefix — as
        one unit that no cancellation can cut short. `held_s`: how long its request ran on it
        (None: it was placed, but its request had left)."""
        if slot.released:
            return
        slot.released = True  # mark first: release exactly once
        self.backpressure.released(slot.replica.id)
        await finish(self._give_back(pool, slot, held_s))

    async def _give_back(self, pool: PoolQueue, slot: Slot, held_s: float | None) -> None:
        pool.released(slot.reserved_blocks, held_s, self.clock())
        try:
            await self.ledger.give_back(slot)
        finally:
            pool.wake.set()

    def retry_after(self, pool: PoolQueue, ahead: int, waiter: Waiter) -> float:
        """Seconds until `ahead + 1` requests' worth of blocks free on the replicas the waiter
        may use (on the shared ledger's count of what they hold)."""
        reserved = sum(self.reserved.get(view.id, 0) for view in waiter.ranking.usable(math.inf))
        return pool.retry_after(ahead, reserved, waiter.config.queue.max_wait_s)

    def _queue_full_error(self, pool_name: str, max_depth: int, waiter: Waiter) -> RateLimited:
        pool = self.pool(pool_name)
        return RateLimited(
            f"the queue for pool {pool_name!r} is full ({max_depth} waiting)",
            code="queue_full",
            retry_after_s=self.retry_after(pool, len(pool.queue), waiter),
        )

    def _observe_depth(self, pool_name: str, pool: PoolQueue) -> None:
        for priority in ("critical", "standard", "sheddable"):
            self.metrics.queue_depth.labels(pool_name, priority).set(pool.queue.depth(priority))

