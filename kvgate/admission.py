"""Admission on KV blocks: a per-replica block ledger in the state store, and a fair queue.

A request is admitted onto a replica only if the blocks kvgate has reserved there (by every
instance sharing the store) plus this request's worst case stay within `target_utilization`
× the replica's `num_gpu_blocks`. Otherwise it waits in its pool's `FairQueue` for at most
`max_wait_s`, or is refused with 429 and an honest `Retry-After`; a request that cannot fit
on any replica of its pool even when empty gets 400 at once.

Each reservation is a lease (`ledger:<replica>`) that `LeaseKeeper` renews while the request
runs; if this instance dies, its leases expire and the capacity returns. `Admission.admit` is
an async context manager: leaving it — completion, error, disconnect, cancellation, even a
second cancellation arriving during the release — releases the lease and the request's share
of its prefix exactly once (`kvgate.protect.finish`).

Head-of-line order: a queued request that does not fit yet blocks those behind it in the same
pool (as vLLM's own waiting queue does), so large requests are never starved by small ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvgate.config import PRIORITY_CLASSES, AdmissionConfig
from kvgate.errors import KvgateError, NeverFits, NoReplica, RateLimited
from kvgate.leases import LeaseKeeper
from kvgate.metrics import Metrics
from kvgate.overcommit import Overcommit
from kvgate.protect import acquire, finish
from kvgate.queue import FairQueue, Ticket
from kvgate.replicas import Replica
from kvgate.shared_prefix import SharedPrefix, SharedPrefixes, credit_blocks
from kvgate.state.base import StateStore, StateStoreError

log = logging.getLogger(__name__)

# While requests wait, look at the shared ledger at least this often. Releases wake the queue
# at once (this instance's directly, other instances' through the store's release notices);
# the poll catches what nobody announces, such as a dead instance's leases expiring.
POLL_INTERVAL_S = 0.1
# How often predicted reservations are checked against what their answers have written.
GROW_INTERVAL_S = 0.05
# A waiter that has used this share of its wait budget is not passed by smaller requests.
AGING_SHARE = 0.5
# The rate a pool frees blocks at, for early refusals, is measured over this window.
FREED_WINDOW_S = 10.0
# Growth is forced: the request already runs, and the ledger must show what it holds.
UNLIMITED = 1 << 40


def ledger_key(replica: Replica) -> str:
    return f"ledger:{replica.id}"


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request needs: its worst case in tokens (the bound), what to reserve now, and
    who asks."""

    pool: str
    model: str
    worst_tokens: int
    tenant: str
    priority: str
    prefix_key: str | None = None  # identifies the prompt's shareable prefix
    prefix_tokens: int = 0
    # The longest the request may hold its reservation (its total timeout): a lease held
    # longer was leaked, and the keeper drops it.
    max_hold_s: float | None = None
    # predicted mode: how far ahead of what it has written the reservation stays (the likely
    # answer, at most the lookahead); it starts at prompt + this and grows with the answer.
    # None: reserve the worst case (worst_case mode, or nothing known yet).
    ahead_tokens: int | None = None
    prompt_tokens: int = 0

    @property
    def reserve_tokens(self) -> int:
        """Tokens to reserve at admission."""
        if self.ahead_tokens is None:
            return self.worst_tokens
        return min(self.worst_tokens, self.prompt_tokens + self.ahead_tokens)

    @property
    def predicted(self) -> bool:
        return self.reserve_tokens < self.worst_tokens

    def blocks_on(self, replica: Replica) -> int:
        """Blocks to reserve on `replica` now."""
        return math.ceil(self.reserve_tokens / (replica.block_size or 16))

    def worst_blocks_on(self, replica: Replica) -> int:
        return math.ceil(self.worst_tokens / (replica.block_size or 16))

    def prefix_blocks_on(self, replica: Replica) -> int:
        if self.prefix_key is None:
            return 0
        return min(self.blocks_on(replica), credit_blocks(self.prefix_tokens, replica.block_size or 16))

    def too_long_for(self, replica: Replica) -> bool:
        limit = replica.max_model_len(self.model)
        return limit is not None and self.worst_tokens > limit


@dataclass(eq=False, slots=True)
class Slot:
    """An admitted request's hold on a replica."""

    replica: Replica
    lease_id: str
    blocks: int  # reserved for this request alone (grows with a predicted answer)
    queued_s: float = 0.0
    shared: SharedPrefix | None = None  # the prefix blocks it shares with others
    released: bool = False
    queued: bool = False  # it waited in the queue (was not admitted on arrival)
    worst_blocks: int = 0  # the request's bound: growth never goes past it
    # tokens the request has written so far (prompt + output), set by the request path; a
    # predicted reservation grows to stay `ahead` tokens ahead of it
    progress: Callable[[], int] | None = None
    ahead: int = 0

    @property
    def reserved_blocks(self) -> int:
        """Blocks reserved for the request, its share of the prefix included."""
        return self.blocks + (self.shared.blocks if self.shared else 0)


def growth_target(slot: Slot) -> int | None:
    """The blocks a predicted reservation should hold now, or None if it is still far enough
    ahead of its answer. Once what it has written comes within half its lookahead of the end,
    it grows to a full lookahead ahead again (at least a block), so vLLM finds the blocks it
    needs already accounted for; never past the request's worst case."""
    if slot.progress is None or slot.released:
        return None
    size = slot.replica.block_size or 16
    held = slot.reserved_blocks
    ceiling = slot.worst_blocks + (slot.shared.blocks if slot.shared else 0)
    if held >= ceiling:
        return None
    written = slot.progress()
    ahead = max(size, slot.ahead)
    if written + ahead // 2 <= held * size:
        return None
    return min(ceiling, math.ceil((written + ahead) / size))


def admissible_blocks(replica: Replica, config: AdmissionConfig) -> int | None:
    total = replica.num_gpu_blocks
    return None if total is None else int(total * config.target_utilization)


@dataclass(slots=True)
class _PoolQueue:
    queue: FairQueue
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    releases: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    freed: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=128))
    worst_cases: deque[int] = field(default_factory=lambda: deque(maxlen=512))

    def freed_per_s(self, now: float) -> float | None:
        """Blocks given back per second over the last FREED_WINDOW_S; None while fewer than
        four releases fall in it (a quiet pool says nothing about how fast it would free)."""
        recent = [(t, b) for t, b in self.freed if now - t <= FREED_WINDOW_S]
        if len(recent) < 4:
            return None
        span = max(now - recent[0][0], 0.1)
        return sum(b for _, b in recent) / span


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
        self._pools: dict[str, _PoolQueue] = {}
        self.reserved: dict[str, int] = {}  # last known ledger totals, for ordering and metrics
        self.prefixes = SharedPrefixes()
        self.overcommit = Overcommit()
        self._growing: set[Slot] = set()  # admitted predicted reservations, grown as they run

    def limit(self, replica: Replica, demand: Demand, config: AdmissionConfig) -> int | None:
        """The ledger's limit for this demand here: the admissible blocks, scaled for
        predicted reservations by how far the replica's own metrics say they can be trusted."""
        limit = admissible_blocks(replica, config)
        if limit is None or not demand.predicted:
            return limit
        return int(limit * self.overcommit.factor(replica.id))

    def _pool(self, name: str) -> _PoolQueue:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = _PoolQueue(FairQueue(self.config().queue.max_depth))
        return pool

    @contextlib.asynccontextmanager
    async def admit(
        self, demand: Demand, candidates: Sequence[Replica]
    ) -> AsyncIterator[Slot]:
        """Reserve the demand's worst case on one of `candidates` (in preference order)."""
        config = self.config()
        if not config.enabled:  # a plain proxy: the first candidate, nothing reserved
            if not candidates:
                raise NoReplica(f"no healthy replica in pool {demand.pool!r} serves this model")
            yield Slot(candidates[0], "", 0, released=True)
            return
        self._check_can_ever_fit(demand, candidates, config)
        pool = self._pool(demand.pool)
        pool.worst_cases.append(max(demand.blocks_on(r) for r in candidates))
        started = time.monotonic()
        slot = None
        if not self._competition(pool, demand, candidates):
            slot = await self._try_place(demand, candidates, config, started)
        if slot is None:
            slot = await self._wait(pool, demand, candidates, config, started)
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
        self, demand: Demand, candidates: Sequence[Replica], config: AdmissionConfig
    ) -> None:
        if not candidates:
            raise NoReplica(f"no healthy replica in pool {demand.pool!r} serves this model")
        limits = [(r, admissible_blocks(r, config)) for r in candidates]
        known = [(r, n) for r, n in limits if n is not None]
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
        candidates: Sequence[Replica],
        config: AdmissionConfig,
        started: float,
    ) -> Slot | None:
        stale = self.stale_after_s()
        for replica in candidates:
            limit = self.limit(replica, demand, config)
            if limit is None or demand.blocks_on(replica) > limit or not replica.healthy:
                continue
            if demand.too_long_for(replica):
                continue
            scrape = replica.fresh_scrape(stale)
            if scrape is not None and (scrape.waiting or 0) > config.max_replica_waiting:
                continue
            slot = await self._place_on(replica, demand, limit, config.lease_ttl_s)
            if slot is not None:
                slot.queued_s = time.monotonic() - started
                return slot
        return None

    async def _place_on(
        self, replica: Replica, demand: Demand, limit: int, ttl: float
    ) -> Slot | None:
        """Reserve on one replica: the request's own blocks, plus (first of its prefix here)
        the shared prefix's blocks as a lease of their own."""
        key, lease_id = ledger_key(replica), os.urandom(12).hex()
        blocks = demand.blocks_on(replica)
        prefix_blocks = demand.prefix_blocks_on(replica)
        shared = None
        if prefix_blocks and demand.prefix_key is not None:
            shared = self.prefixes.get(replica.id, demand.prefix_key)
            if shared is None:
                shared = self.prefixes.open(replica.id, demand.prefix_key, prefix_blocks)
                own_later = blocks - prefix_blocks
                try:
                    shared.live = await self._acquire(
                        key, shared.lease_id, prefix_blocks, limit - own_later, ttl
                    )
                finally:
                    if not shared.live:
                        self.prefixes.drop(shared)  # refused, failed or cancelled
                if not shared.live:
                    return None
                self.keeper.add(key, shared.lease_id)  # lives while requests share it
                self._count(replica.id, prefix_blocks)
            elif shared.live and shared.blocks <= prefix_blocks:
                shared.refs += 1
            else:
                # being acquired by another request, or larger than this request's own prefix
                # (its estimate moved since): no credit, lest the request reserve less than 0
                shared = None
        own = max(0, blocks - (shared.blocks if shared else 0))
        try:
            granted = await self._acquire(key, lease_id, own, limit, ttl)
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
        self._count(replica.id, own)
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
        key = f"ledger:{shared.replica_id}"
        self.keeper.discard(key, shared.lease_id)
        self._count(shared.replica_id, -shared.blocks)
        await self._release_lease(key, shared.lease_id)

    def _count(self, replica_id: str, blocks: int) -> None:
        self.reserved[replica_id] = max(0, self.reserved.get(replica_id, 0) + blocks)

    async def _acquire(self, key: str, lease_id: str, blocks: int, limit: int, ttl: float) -> bool:
        """try_acquire that cannot leak: if we are cancelled while the store works, a lease it
        grants anyway is released before the cancellation goes on."""

        async def undo(granted: bool) -> None:
            if granted:
                await self._release_lease(key, lease_id)

        return await acquire(self.store.try_acquire(key, lease_id, blocks, limit, ttl), undo)

    async def _wait(
        self,
        pool: _PoolQueue,
        demand: Demand,
        candidates: Sequence[Replica],
        config: AdmissionConfig,
        started: float,
    ) -> Slot:
        """Queue the demand until the dispatcher places it, within its class's wait budget.
        One that could not start within the budget at the recent rate of releases is refused
        at once: waiting it out would only miss its latency target later."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Slot] = loop.create_future()
        ticket = Ticket(demand.tenant, demand.priority, started, (demand, candidates, future))
        refused = pool.queue.push(ticket)
        if refused is ticket:
            raise self._queue_full_error(demand.pool, config)
        if refused is not None:
            _, _, shed_future = refused.payload
            if not shed_future.done():
                shed_future.set_exception(self._queue_full_error(demand.pool, config))
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

    def _competition(
        self, pool: _PoolQueue, demand: Demand, candidates: Sequence[Replica],
        upto: Ticket | None = None, room: int | None = None,
    ) -> list[Ticket]:
        """The queued requests, ahead in service order (up to `upto`), that want one of these
        replicas and will start before this demand: every one of a better class; of its own
        class, those that fit in `room` or have aged (a larger one that does not fit yet is
        passed)."""
        rank = PRIORITY_CLASSES.index(demand.priority)
        ids = {r.id for r in candidates}
        budget = self.config().queue.budget(demand.priority)
        now = time.monotonic()
        ahead = []
        for queued in pool.queue:
            if queued is upto:
                break
            queued_demand, queued_candidates, future = queued.payload
            if future.done() or queued.rank > rank:
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

    def expected_wait(self, pool: _PoolQueue, ticket: Ticket, config: AdmissionConfig) -> float | None:
        """Seconds until this request and those that start before it could all run, at the
        rate the pool has freed blocks over the last FREED_WINDOW_S; None when they may fit
        now or that rate is unknown."""
        demand, candidates, _ = ticket.payload
        free = 0
        for replica in candidates:
            limit = self.limit(replica, demand, config)
            if limit is not None and replica.healthy:
                free += max(0, limit - self.reserved.get(replica.id, 0))
        needed = min((demand.blocks_on(r) for r in candidates), default=0)
        for queued in self._competition(pool, demand, candidates, upto=ticket, room=free):
            queued_demand, queued_candidates, _ = queued.payload
            needed += min((queued_demand.blocks_on(r) for r in queued_candidates), default=0)
        if needed <= free:
            return None  # it may start now: let the dispatcher try
        rate = pool.freed_per_s(time.monotonic())
        if not rate:
            return None
        return min(config.queue.max_wait_s, (needed - free) / rate)

    async def dispatch(self, pool_name: str) -> None:
        """Serve one pool's queue in fair order until cancelled (one task per pool).

        A request that does not fit yet does not hold back the smaller ones behind it (no
        head-of-line blocking across replicas), unless it has used AGING_SHARE of its wait
        budget: then nothing passes it, so capacity gathers for it and large requests still
        make progress. Within a pass, once a request of n blocks did not fit, larger ones are
        not tried."""
        pool = self._pool(pool_name)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_INTERVAL_S if len(pool.queue) else None):
                    await pool.wake.wait()
            pool.wake.clear()
            await self._serve_pass(pool)

    async def _serve_pass(self, pool: _PoolQueue) -> None:
        """One pass over the queue in service order. A request that does not fit puts up a
        barrier on the replicas it could use: requests of a lower class may not take them, nor
        may anyone once it has used AGING_SHARE of its wait budget. Requests for other replicas
        go on. Within a pass, once a request of n blocks did not fit on a set of replicas,
        larger ones for the same set are not tried."""
        config = self.config()
        now = time.monotonic()
        barriers: list[tuple[int, bool, frozenset[str]]] = []  # (rank, aged, replica ids)
        refused: dict[tuple[frozenset[str], bool], int] = {}
        for ticket in list(pool.queue):
            demand, candidates, future = ticket.payload
            if future.done():
                pool.queue.remove(ticket)
                continue
            closed = {
                rid for rank, aged, ids in barriers if aged or rank < ticket.rank for rid in ids
            }
            usable = [r for r in candidates if r.id not in closed]
            if not usable:
                continue
            ids = frozenset(r.id for r in usable)
            need = min(demand.blocks_on(r) for r in usable)
            smallest = refused.get((ids, demand.predicted))
            if smallest is not None and need >= smallest:
                continue
            try:
                slot = await self._try_place(demand, usable, config, ticket.enqueued_at)
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
        key = ledger_key(slot.replica)
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

    async def _release(self, pool: _PoolQueue, slot: Slot) -> None:
        """Give back everything the slot holds — its lease, then its share of the prefix — as
        one unit that no cancellation can cut short."""
        if slot.released:
            return
        slot.released = True  # mark first: release exactly once
        await finish(self._give_back(pool, slot))

    async def _give_back(self, pool: _PoolQueue, slot: Slot) -> None:
        key = ledger_key(slot.replica)
        self.keeper.discard(key, slot.lease_id)
        self._count(slot.replica.id, -slot.blocks)
        now = time.monotonic()
        pool.releases.append(now)
        pool.freed.append((now, slot.reserved_blocks))
        try:
            await self._release_lease(key, slot.lease_id)
            if slot.shared is not None:
                await self._unshare(slot.shared)
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
        pool = self._pool(pool_name)
        max_wait = self.config().queue.max_wait_s
        if len(pool.releases) >= 2:
            span = max(1e-3, time.monotonic() - pool.releases[0])
            rate = len(pool.releases) / span
            return min(max(1.0, (ahead + 1) / rate), max(1.0, max_wait))
        return max(1.0, min(max_wait, 5.0))

    def p95_worst_case(self, pool_name: str) -> int | None:
        cases = sorted(self._pool(pool_name).worst_cases)
        return cases[min(len(cases) - 1, int(0.95 * len(cases)))] if cases else None

    def _queue_full_error(self, pool_name: str, config: AdmissionConfig) -> RateLimited:
        depth = len(self._pool(pool_name).queue)
        return RateLimited(
            f"the queue for pool {pool_name!r} is full ({config.queue.max_depth} waiting)",
            code="queue_full",
            retry_after_s=self.retry_after(pool_name, depth),
        )

    def _refuse_queue_full(self, pool_name: str, ticket: Ticket, config: AdmissionConfig) -> None:
        raise self._queue_full_error(pool_name, config)

    def _observe_depth(self, pool_name: str, pool: _PoolQueue) -> None:
        for priority in ("critical", "standard", "sheddable"):
            self.metrics.queue_depth.labels(pool_name, priority).set(pool.queue.depth(priority))

