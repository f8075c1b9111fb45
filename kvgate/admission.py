"""Admission on KV blocks: a per-replica block ledger in the state store, and a fair queue.

A request is admitted onto a replica only if the blocks kvgate has reserved there (by every
instance sharing the store) plus this request's reservation stay within `target_utilization`
× the replica's `num_gpu_blocks` (scaled by the replica's overcommit factor in predicted
mode). Otherwise it waits in its pool's `FairQueue` within its class's wait budget, or is
refused with 429 and an honest `Retry-After`; a request whose worst case cannot fit on any
replica of its pool even when empty gets 400 at once.

Each reservation is a lease (`ledger:<replica>`) that `LeaseKeeper` renews while the request
runs; if this instance dies, its leases expire and the capacity returns. `Admission.admit` is
an async context manager: leaving it — completion, error, disconnect, cancellation, even a
second cancellation arriving during the release — releases the lease and the request's share
of its prefix exactly once (`kvgate.protect.finish`).

Queue order: a request that does not fit yet holds back lower classes on the replicas it
could use, and everyone there once it has used half its wait budget, so large requests still
make progress; otherwise smaller requests pass it. What a request needs and holds (`Demand`,
`Slot`) lives in `kvgate.demand`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

from kvgate.config import AdmissionConfig
from kvgate.demand import Demand, Slot, growth_target, ledger_key
from kvgate.errors import KvgateError, NeverFits, NoReplica, RateLimited
from kvgate.leases import LeaseKeeper
from kvgate.metrics import Metrics
from kvgate.overcommit import Overcommit
from kvgate.protect import acquire, finish, together
from kvgate.queue import FairQueue, Ticket
from kvgate.replicas import Replica
from kvgate.routing.fleet import Fleet, ReplicaView, take_snapshot
from kvgate.routing.router import Ranking
from kvgate.shared_prefix import SharedPrefix, SharedPrefixes
from kvgate.state.base import StateStore, StateStoreError
from kvgate.waiting import AGING_SHARE, PoolQueue, Waiter

log = logging.getLogger(__name__)

# While requests wait, look at the shared ledger at least this often. Releases wake the queue
# at once (this instance's directly, other instances' through the store's release notices);
# the poll catches what nobody announces, such as a dead instance's leases expiring.
POLL_INTERVAL_S = 0.1
# How often predicted reservations are checked against what their answers have written.
GROW_INTERVAL_S = 0.05
# Growth is forced: the request already runs, and the ledger must show what it holds.
UNLIMITED = 1 << 40

# Ranks the replicas for one request, given the seconds it has waited so far; called on arrival
# and again on every placement attempt, so a queued request goes where room appears.
Ranker = Callable[[float], Awaitable[Ranking]]


class Admission:
    def __init__(
        self,
        store: StateStore,
        metrics: Metrics,
        config: Callable[[], AdmissionConfig],
        keeper: LeaseKeeper,
        stale_after_s: Callable[[], float],
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.config = config
        self.keeper = keeper
        self.stale_after_s = stale_after_s
        self._pools: dict[str, PoolQueue] = {}
        self.reserved: dict[str, int] = {}  # last known ledger totals, for ordering and metrics
        self._pending: dict[str, int] = {}  # blocks being acquired now, per replica
        self.prefixes = SharedPrefixes()
        self.overcommit = Overcommit()
        self._growing: set[Slot] = set()  # admitted predicted reservations, grown as they run

    def configure(self, config: AdmissionConfig) -> None:
        """A reload: queues take the new depth (a shorter one sheds nobody already waiting;
        it refuses newcomers until it drains below), leases the new TTL."""
        for pool in self._pools.values():
            pool.queue.max_depth = config.queue.max_depth
        self.keeper.ttl_s = config.lease_ttl_s

    def snapshot(
        self, replicas: Iterable[Replica], circuit: Callable[[str], str] = lambda _: "closed"
    ) -> Fleet:
        """The replicas as they stand now, with this ledger's figures."""
        return take_snapshot(
            replicas,
            config=self.config(),
            stale_after_s=self.stale_after_s(),
            reserved=self.reserved,
            shared_prefix_blocks=self.prefixes.held_blocks,
            circuit=circuit,
            overcommit=self.overcommit.factor,
            typical_blocks=self.p95_worst_case,
        )

    def in_order(self, replicas: Sequence[Replica]) -> Ranker:
        """A ranker that tries `replicas` in the order given, each as it is at the attempt
        (for callers that have chosen already, and tests)."""

        async def rank(waited_s: float) -> Ranking:
            return Ranking(list(self.snapshot(replicas)))

        return rank

    def _pool(self, name: str) -> PoolQueue:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = PoolQueue(FairQueue(self.config().queue.max_depth))
        return pool

    @contextlib.asynccontextmanager
    async def admit(self, demand: Demand, rank: Ranker) -> AsyncIterator[Slot]:
        """Reserve the demand on the first replica of its ranking with room, now or from the
        queue (ranked again on every attempt)."""
        config = self.config()
        started = time.monotonic()
        ranking = await rank(0.0)
        candidates = [v.replica for v in ranking.replicas]
        if not config.enabled:  # a plain proxy: the first candidate, nothing reserved
            if not candidates:
                raise NoReplica(f"no healthy replica in pool {demand.pool!r} serves this model")
            yield Slot(candidates[0], "", 0, released=True)
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
        slot = await self._try_place(demand, ranking, config, 0.0, waited_for)
        if slot is None:
            slot = await self._wait(pool, demand, rank, ranking, config, started)
        self.metrics.admissions.labels(
            demand.pool, slot.replica.id, "yes" if slot.queued else "no"
        ).inc()
        self.metrics.worst_case_blocks.labels(demand.pool).observe(
            demand.worst_blocks_on(slot.replica)
        )
        if demand.predicted:
            self._growing.add(slot)
        try:
            yield slot
        finally:
            self._growing.discard(slot)
            await self._release(pool, slot)

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
            slot = await self._place_on(view.replica, demand, limit, config.lease_ttl_s)
            if slot is not None:
                slot.queued_s = waited_s
                return slot
        return None

    async def _place_on(
        self, replica: Replica, demand: Demand, limit: int, ttl: float
    ) -> Slot | None:
        """Reserve on one replica: the request's own blocks, plus (first of its prefix here)
        the shared prefix's blocks as a lease of their own."""
        key, lease_id = ledger_key(replica.id), os.urandom(12).hex()
        blocks = demand.blocks_on(replica)
        prefix_blocks = demand.prefix_blocks_on(replica)
        shared = None
        own_granted: bool | None = None  # when taken together with a new prefix's lease
        if prefix_blocks and demand.prefix_key is not None:
            shared = self.prefixes.get(replica.id, demand.prefix_key)
            if shared is None:
                shared = self.prefixes.open(replica.id, demand.prefix_key, prefix_blocks)
                own_later = blocks - prefix_blocks
                try:
                    shared.live, own_granted = await self._acquire_both(
                        replica.id, shared.lease_id, prefix_blocks, lease_id, own_later,
                        limit, ttl,
                    )
                finally:
                    if not shared.live:
                        self.prefixes.drop(shared)  # refused, failed or cancelled
                if not shared.live:
                    return None
                self.keeper.add(key, shared.lease_id)  # lives while requests share it
            elif shared.live and shared.blocks <= prefix_blocks:
                shared.refs += 1
            else:
                # being acquired by another request, or larger than this request's own prefix
                # (its estimate moved since): no credit, lest the request reserve less than 0
                shared = None
        own = max(0, blocks - (shared.blocks if shared else 0))
        try:
            granted = (
                own_granted if own_granted is not None
                else await self._acquire(replica.id, lease_id, own, limit, ttl)
            )  # fmt: skip
        except BaseException:  # store failure or cancellation: the prefix is not ours to keep
            if shared is not None:
                await finish(self._unshare(shared))
            raise
        if not granted:
            if shared is not None:
                await finish(self._unshare(shared))
            return None
        worst_own = demand.worst_blocks_on(replica) - (shared.blocks if shared else 0)
        slot = Slot(replica, lease_id, own, shared=shared, worst_blocks=max(own, worst_own),
                    ahead=demand.ahead_tokens or 0)
        self.keeper.add(
            key, lease_id, max_age_s=demand.max_hold_s,
            on_stale=lambda: self._release(self._pool(demand.pool), slot),
        )
        return slot

    async def _unshare(self, shared: SharedPrefix) -> None:
        shared.refs -= 1
        if shared.refs > 0:
            return
        self.prefixes.drop(shared)
        key = ledger_key(shared.replica_id)
        self.keeper.discard(key, shared.lease_id)
        self._count(shared.replica_id, -shared.blocks)
        await self._release_lease(key, shared.lease_id)

    def _count(self, replica_id: str, blocks: int) -> None:
        self.reserved[replica_id] = max(0, self.reserved.get(replica_id, 0) + blocks)

    async def _acquire(
        self, replica_id: str, lease_id: str, blocks: int, limit: int, ttl: float
    ) -> bool:
        """try_acquire that cannot leak: if we are cancelled while the store works, a lease it
        grants anyway is released before the cancellation goes on. The blocks count in this
        instance's ledger figures while the store decides, so requests ranked meanwhile see
        them (else a burst would all rank against the same empty ledger)."""
        key = ledger_key(replica_id)

        async def undo(granted: bool) -> None:
            if granted:
                await self._release_lease(key, lease_id)

        self._count(replica_id, blocks)
        self._pending[replica_id] = self._pending.get(replica_id, 0) + blocks
        granted = False
        try:
            granted = await acquire(
                self.store.try_acquire(key, lease_id, blocks, limit, ttl), undo
            )
        finally:
            self._pending[replica_id] -= blocks
            if not granted:
                self._count(replica_id, -blocks)
        return granted

    async def _acquire_both(
        self, replica_id: str, prefix_id: str, prefix_blocks: int, own_id: str, own: int,
        limit: int, ttl: float,
    ) -> tuple[bool, bool]:
        """A new shared prefix's lease and the request's own, in one round trip with a
        pipelining store (issue 14): the prefix first, within room for both, then the own
        blocks. A refused prefix keeps nothing: (False, False). Protected, and counted while
        the store decides, as in `_acquire`."""
        key = ledger_key(replica_id)

        async def both() -> tuple[bool, bool]:
            prefix, mine = await together(
                self.store.try_acquire(key, prefix_id, prefix_blocks, limit - own, ttl),
                self.store.try_acquire(key, own_id, own, limit, ttl),
            )
            failed = next((r for r in (prefix, mine) if isinstance(r, BaseException)), None)
            if failed is None and prefix is True:
                return True, mine is True
            await together(*(
                self._release_lease(key, lease) for got, lease in ((prefix, prefix_id), (mine, own_id))
                if got is True
            ))  # fmt: skip
            if failed is not None:
                raise failed
            return False, False

        async def undo(granted: tuple[bool, bool]) -> None:
            await together(*(
                self._release_lease(key, lease)
                for got, lease in zip(granted, (prefix_id, own_id), strict=True) if got
            ))  # fmt: skip

        self._count(replica_id, prefix_blocks + own)
        self._pending[replica_id] = self._pending.get(replica_id, 0) + prefix_blocks + own
        granted = (False, False)
        try:
            granted = await acquire(both(), undo)
        finally:
            self._pending[replica_id] -= prefix_blocks + own
            self._count(replica_id, -(prefix_blocks * (not granted[0]) + own * (not granted[1])))
        return granted

    def observed(self, replica_id: str, held: int) -> None:
        """The store says the ledger holds `held`: that, plus what is being acquired now (the
        store's figure cannot include it yet), is what routing and the gauges see."""
        self.reserved[replica_id] = held + self._pending.get(replica_id, 0)

    def forget(self, keep: set[str]) -> None:
        """Drop the figures of replicas no longer in the fleet."""
        for figures in (self.reserved, self._pending):
            for replica_id in [r for r in figures if r not in keep]:
                del figures[replica_id]

    async def _wait(
        self,
        pool: PoolQueue,
        demand: Demand,
        rank: Ranker,
        ranking: Ranking,
        config: AdmissionConfig,
        started: float,
    ) -> Slot:
        """Queue the demand until the dispatcher places it, within its class's wait budget.
        One that could not start within the budget at the recent rate of releases is refused
        at once: waiting it out would only miss its latency target later."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Slot] = loop.create_future()
        waiter = Waiter(demand, rank, future, ranking, started)
        ticket = Ticket(demand.tenant, demand.priority, started, waiter)
        refused = pool.queue.push(ticket)
        if refused is ticket:
            raise self._queue_full_error(demand.pool, config)
        if refused is not None:
            shed: Waiter = refused.payload
            if not shed.future.done():
                shed.future.set_exception(self._queue_full_error(demand.pool, config))
        budget = config.queue.budget(demand.priority)
        expected = self.expected_wait(pool, ticket, config)
        if expected is not None and expected > budget:
            pool.queue.remove(ticket)
            raise RateLimited(
                f"no KV capacity in pool {demand.pool!r} within this request's wait budget "
                f"of {budget:g}s (about {expected:.1f}s at the recent rate)",
                code="wait_budget_exceeded", retry_after_s=expected,
            )
        self._observe_depth(demand.pool, pool)
        pool.wake.set()
        try:
            async with asyncio.timeout(budget):
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
                    retry_after_s=self.retry_after(demand.pool, len(pool.queue)),
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
        """One pass over the queue in service order, each request ranked afresh. A request
        that does not fit puts up a barrier on the replicas it could use: requests of a lower
        class may not take them, nor may anyone once it has used AGING_SHARE of its wait
        budget (so large requests still make progress). Requests for other replicas go on.
        Within a pass, once a request of n blocks did not fit on a set of replicas, larger
        ones for the same set are not tried."""
        config = self.config()
        now = time.monotonic()
        barriers: list[tuple[int, bool, frozenset[str]]] = []  # (rank, aged, replica ids)
        refused: dict[tuple[frozenset[str], bool], int] = {}
        for ticket in list(pool.queue):
            waiter: Waiter = ticket.payload
            demand, future = waiter.demand, waiter.future
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

    async def grow(self) -> None:
        """Keep every predicted reservation ahead of its answer, until cancelled (one task)."""
        while True:
            await asyncio.sleep(GROW_INTERVAL_S)
            for slot in list(self._growing):
                target = growth_target(slot)
                if target is not None:
                    await self._grow(slot, target)

    async def _grow(self, slot: Slot, total_blocks: int) -> None:
        own = total_blocks - (slot.shared.blocks if slot.shared else 0)
        if own <= slot.blocks or slot.released:
            return
        key = ledger_key(slot.replica.id)
        try:
            await self.store.try_acquire(
                key, slot.lease_id, own, UNLIMITED, self.config().lease_ttl_s
            )
        except (StateStoreError, KvgateError) as exc:
            log.warning("could not grow a reservation on %s: %s", key, exc)
            return
        if slot.released:  # released while the store grew it: the lease must not come back
            await finish(self._release_lease(key, slot.lease_id))
            return
        self._count(slot.replica.id, own - slot.blocks)
        slot.blocks = own
        self.metrics.reservation_growths.labels(slot.replica.pool).inc()

    def after_discovery(self, replicas: Iterable[Replica]) -> None:
        """A discovery round brought fresh scrapes: steer each replica's overcommit by them,
        then let the queues try again."""
        stale = self.stale_after_s()
        waiting = {name for name, pool in self._pools.items() if len(pool.queue)}
        for replica in replicas:
            scrape = replica.fresh_scrape(stale)
            if scrape is None:
                continue
            factor = self.overcommit.observe(
                replica.id, preemptions=scrape.preemptions, kv_usage=scrape.kv_usage,
                demand=replica.pool in waiting, waiting=scrape.waiting,
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
        await finish(self._give_back(pool, slot))

    async def _give_back(self, pool: PoolQueue, slot: Slot) -> None:
        key = ledger_key(slot.replica.id)
        self.keeper.discard(key, slot.lease_id)
        self._count(slot.replica.id, -slot.blocks)
        now = time.monotonic()
        pool.releases.append(now)
        pool.freed.append((now, slot.reserved_blocks))
        try:  # together: one round trip with a pipelining store
            for outcome in await together(
                self._release_lease(key, slot.lease_id),
                None if slot.shared is None else self._unshare(slot.shared),
            ):
                if isinstance(outcome, BaseException):
                    raise outcome
        finally:
            pool.wake.set()

    async def _release_lease(self, key: str, lease_id: str) -> None:
        try:
            await self.store.release(key, lease_id)
        except (StateStoreError, KvgateError) as exc:
            # The lease stops being renewed and expires within its TTL: capacity comes back.
            log.warning("could not release lease on %s (expires by TTL): %s", key, exc)

    def retry_after(self, pool_name: str, ahead: int) -> float:
        """Seconds until `ahead + 1` requests' worth of capacity frees, at the recent rate."""
        return self._pool(pool_name).retry_after(ahead, self.config().queue.max_wait_s)

    def p95_worst_case(self, pool_name: str) -> int | None:
        return self._pool(pool_name).p95_reservation()

    def _queue_full_error(self, pool_name: str, config: AdmissionConfig) -> RateLimited:
        depth = len(self._pool(pool_name).queue)
        return RateLimited(
            f"the queue for pool {pool_name!r} is full ({config.queue.max_depth} waiting)",
            code="queue_full",
            retry_after_s=self.retry_after(pool_name, depth),
        )

    def _observe_depth(self, pool_name: str, pool: PoolQueue) -> None:
        for priority in ("critical", "standard", "sheddable"):
            self.metrics.queue_depth.labels(pool_name, priority).set(pool.queue.depth(priority))

