"""The block ledger: what this instance has reserved on each replica's ledger in the state
store, as leases, and the arithmetic of sharing a prompt's prefix.

`reserve` takes a request's blocks on one replica (and, first of its prefix there, the prefix's
blocks as a lease of their own) within a limit, or says there is no room; `give_back` returns
all of it. Every step that takes a lease cannot leak it: cancelled while the store works, a
lease granted anyway is released before the cancellation goes on (`kvgate.protect.acquire`);
the caller releases a slot as one protected unit (`kvgate.protect.finish`). Predicted
reservations grow with their answers (`grow`).

`reserved` is this instance's view of every replica's ledger, for routing and the gauges. It
moves at once with this instance's own changes (a reservation counts while the store decides
on it, a release stops counting before the store hears of it); what other instances hold is
learned only by reading the store back (`reconcile`, its own loop). A read is applied only
if none of this instance's changes on that replica was on its way to the store while the read
was: the store may have served the read before or after such a change, so its figure cannot
say which of its blocks are ours. Correcting the figure by our changes made meanwhile would be
right only when the store served the read first; when it did not, a release would be taken
off twice and a replica would look emptier than it is, until the next read. A read that is
not applied leaves other instances' figures one interval older, as they always are between
reads; our own are never stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Hashable, Iterator, Sequence

from kvgate.admission.demand import Demand, Slot, growth_target, ledger_key
from kvgate.admission.leases import LeaseKeeper
from kvgate.admission.shared_prefix import ReplicaShare, SharedBlocks, SharedUse
from kvgate.errors import KvgateError
from kvgate.fleet.replicas import Replica
from kvgate.metrics import Metrics
from kvgate.protect import acquire, finish, together
from kvgate.state.base import StateStore, StateStoreError

log = logging.getLogger(__name__)

# How often predicted reservations are checked against what their answers have written.
GROW_INTERVAL_S = 0.05
# Growth is forced: the request already runs, and the ledger must show what it holds.
UNLIMITED = 1 << 40
# How often every replica's ledger is read back from the store (other instances' blocks).
RECONCILE_INTERVAL_S = 1.0


class Ledger:
    def __init__(self, store: StateStore, keeper: LeaseKeeper, metrics: Metrics) -> None:
        self.store = store
        self.keeper = keeper
        self.metrics = metrics
        self.reserved: dict[str, int] = {}  # every instance's blocks, as this one sees them
        # per replica: this instance's changes on their way to the store, and a count that
        # moves whenever one starts or ends (a read is applied only if it did not move)
        self._unsettled: dict[str, int] = {}
        self._changes: dict[str, int] = {}
        self.prefixes = SharedBlocks()
        self.growing: set[Slot] = set()  # admitted predicted reservations, grown as they run
        self.exact: dict[str, int] = {}  # of `reserved`, this instance's worst-case reservations
        # of `reserved`, this instance's reservations of the classes below critical: their
        # answers' growth is never refused, so it may run past their limit, and the blocks
        # kept for the critical class are then counted on top of it (`ReplicaView.limit`)
        self.lower: dict[str, int] = {}

    async def reserve(
        self,
        replica: Replica,
        demand: Demand,
        limit: int,
        ttl: float,
        on_stale: Callable[[Slot], Awaitable[None]],
    ) -> Slot | None:
        """Reserve on one replica, within `limit` blocks: the request's own blocks, and those
        of its shared blocks that no live request here counts yet, on the replica's shared
        lease. None: no room. `on_stale` releases the slot if its request holds it past
        `demand.max_hold_s`."""
        key, lease_id = ledger_key(replica.id), os.urandom(12).hex()
        blocks = demand.blocks_on(replica)
        keys = demand.shared_keys_on(replica)
        shared: SharedUse | None = None
        if keys:
            shared = await self._share(replica.id, keys, lease_id, blocks - len(keys), limit, ttl)
            if shared is None:
                return None
        elif not await self._acquire(replica.id, lease_id, blocks, limit, ttl):
            return None
        own = blocks - len(keys)
        worst_own = demand.worst_blocks_on(replica) - len(keys)
        slot = Slot(replica, lease_id, own, shared=shared, worst_blocks=max(own, worst_own),
                    ahead=demand.margin_tokens, forecast=demand.forecast, alive=demand.alive,
                    exact=not demand.predicted, lower_class=demand.priority != "critical")
        if slot.exact:
            self.exact[replica.id] = self.exact.get(replica.id, 0) + own
        if slot.lower_class:
            self._count_lower(replica.id, own)
        self.keeper.add(
            key, lease_id, max_age_s=demand.max_hold_s, on_stale=lambda: on_stale(slot), ttl_s=ttl,
        )
        return slot

    async def _share(
        self, replica_id: str, keys: Sequence[Hashable], own_id: str, own: int, limit: int,
        ttl: float,
    ) -> SharedUse | None:
        """The request's own blocks, and its shared `keys` on the replica: those live requests
        there count already are its credit, the rest grow the replica's shared lease, in one
        round trip with a pipelining store. None: no room, and nothing is kept. The replica's
        shared blocks change one request at a time (its lock), so the lease's amount in the
        store follows the count in order."""
        share = self.prefixes.of(replica_id)
        async with share.lock:
            new = len(keys) - share.credit(keys)
            if new == 0:
                granted = await self._acquire(replica_id, own_id, own, limit, ttl)
            else:
                granted = await self._acquire_both(replica_id, share, new, own_id, own, limit, ttl)
            if not granted:
                return None
            had = share.held
            share.add(keys)
            if not had:
                self.keeper.add(ledger_key(replica_id), share.lease_id, ttl_s=ttl)  # while used
        return SharedUse(share, keys)

    async def _unshare(self, shared: SharedUse) -> None:
        """The request's shared keys stop counting: the replica's shared lease shrinks by the
        blocks no live request uses any more (released once none is left)."""
        share = shared.share
        key = ledger_key(share.replica_id)
        async with share.lock:
            dropped = share.remove(shared.keys)
            if not dropped:
                return
            with self._changing(share.replica_id):
                self._count(share.replica_id, -dropped)
                if share.held:
                    await self._set_shared(share, share.held)
                else:
                    self.keeper.discard(key, share.lease_id)
                    await self.release_lease(key, share.lease_id)

    async def _set_shared(self, share: ReplicaShare, blocks: int) -> None:
        """The replica's shared lease at `blocks` (a shrink, or an undone growth: no limit)."""
        try:
            await self.store.try_acquire(
                ledger_key(share.replica_id), share.lease_id, blocks, UNLIMITED, self.keeper.ttl_s
            )
        except (StateStoreError, KvgateError) as exc:
            # it stays at its larger amount until the next change sets it, or expires by TTL
            log.warning("could not set the shared blocks on %s: %s", share.replica_id, exc)

    def _count(self, replica_id: str, blocks: int) -> None:
        self.reserved[replica_id] = max(0, self.reserved.get(replica_id, 0) + blocks)

    @contextlib.contextmanager
    def _changing(self, replica_id: str) -> Iterator[None]:
        """One change of this instance's on the replica's ledger, from its count in `reserved`
        until the store has answered: reads of the store meanwhile are not applied."""
        self._unsettled[replica_id] = self._unsettled.get(replica_id, 0) + 1
        self._changes[replica_id] = self._changes.get(replica_id, 0) + 1
        try:
            yield
        finally:
            self._unsettled[replica_id] -= 1
            self._changes[replica_id] += 1

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
                await self.release_lease(key, lease_id)

        granted = False
        with self._changing(replica_id):
            self._count(replica_id, blocks)
            try:
                granted = await acquire(
                    self.store.try_acquire(key, lease_id, blocks, limit, ttl), undo
                )
            finally:
                if not granted:
                    self._count(replica_id, -blocks)
        return granted

    async def _acquire_both(
        self, replica_id: str, share: ReplicaShare, new: int, own_id: str, own: int,
        limit: int, ttl: float,
    ) -> bool:
        """The replica's shared lease grown by `new` blocks, within room for the request's own
        too, and the request's own lease, in one round trip with a pipelining store. Both or
        neither: what one took is given back when the other was refused or failed.
        Protected, and counted while the store decides, as in `_acquire`. Called under the
        share's lock."""
        key, before = ledger_key(replica_id), share.held

        async def give_back(grew: object, mine: object) -> None:
            await together(
                self._undo_growth(share, before) if grew is True else None,
                self.release_lease(key, own_id) if mine is True else None,
            )

        async def both() -> bool:
            grew, mine = await together(
                self.store.try_acquire(key, share.lease_id, before + new, limit - own, ttl),
                self.store.try_acquire(key, own_id, own, limit, ttl),
            )
            if grew is True and mine is True:
                return True
            await give_back(grew, mine)
            failed = next((r for r in (grew, mine) if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
            return False

        async def undo(granted: bool) -> None:
            if granted:
                await give_back(True, True)

        granted = False
        with self._changing(replica_id):
            self._count(replica_id, new + own)
            try:
                granted = await acquire(both(), undo)
            finally:
                if not granted:
                    self._count(replica_id, -(new + own))
        return granted

    async def _undo_growth(self, share: ReplicaShare, before: int) -> None:
        """The shared lease back at `before` blocks: released if that is none."""
        if before:
            await self._set_shared(share, before)
        else:
            await self.release_lease(ledger_key(share.replica_id), share.lease_id)

    async def reconcile(self, replica_ids: Callable[[], Collection[str]]) -> None:
        """Read every replica's ledger back from the store each RECONCILE_INTERVAL_S, then
        drop the figures of replicas no longer in the fleet, until cancelled (one task). A
        ledger the store cannot read keeps its figure (the store counts its own errors)."""
        while True:
            for replica_id in replica_ids():
                try:
                    await self.refresh(replica_id)
                except (StateStoreError, KvgateError) as exc:
                    log.debug("ledger of %s not read: %s", replica_id, exc)
            self.forget(set(replica_ids()))
            await asyncio.sleep(RECONCILE_INTERVAL_S)

    async def refresh(self, replica_id: str) -> None:
        """Read the replica's ledger (every instance's blocks) from the store into `reserved`,
        unless one of this instance's changes there was on its way to the store meanwhile."""
        held = await self.quiet_read(replica_id)
        if held is not None:
            self.reserved[replica_id] = held

    async def quiet_read(self, replica_id: str) -> int | None:
        """The replica's ledger as the store holds it, read while none of this instance's
        changes there was on its way (none under way, none begun meanwhile: the read
        suspends); None where the moment was not quiet."""
        if self._unsettled.get(replica_id, 0):
            return None
        before = self._changes.get(replica_id, 0)
        held = await self.store.held(ledger_key(replica_id))
        return held if self._changes.get(replica_id, 0) == before else None

    def forget(self, keep: set[str]) -> None:
        """Drop the figures of replicas no longer in the fleet (but not the count of changes
        still on their way to the store)."""
        self.prefixes.forget(keep)
        settled = {r for r, n in self._unsettled.items() if n == 0}
        for figures in (self.reserved, self.exact):
            for replica_id in [r for r in figures if r not in keep]:
                del figures[replica_id]
        for replica_id in settled - keep:
            del self._unsettled[replica_id]
            self._changes.pop(replica_id, None)

    def _count_lower(self, replica_id: str, blocks: int) -> None:
        left = self.lower.get(replica_id, 0) + blocks
        if left > 0:
            self.lower[replica_id] = left
        else:
            self.lower.pop(replica_id, None)

    async def give_back(self, slot: Slot) -> None:
        """Release the slot's lease and its share of the prefix, together (one round trip
        with a pipelining store). Run it through `finish`: it must not be cut short."""
        self.growing.discard(slot)
        if slot.lower_class:
            self._count_lower(slot.replica.id, -slot.blocks)
        key = ledger_key(slot.replica.id)
        self.keeper.discard(key, slot.lease_id)
        if slot.exact:  # the replica may have left the fleet (forget) meanwhile
            left = self.exact.pop(slot.replica.id, 0) - slot.blocks
            if left > 0:
                self.exact[slot.replica.id] = left
        with self._changing(slot.replica.id):
            self._count(slot.replica.id, -slot.blocks)
            outcomes = await together(
                self.release_lease(key, slot.lease_id),
                None if slot.shared is None else self._unshare(slot.shared),
            )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def grow(self) -> None:
        """Keep every predicted reservation ahead of its answer, until cancelled (one task)."""
        while True:
            await asyncio.sleep(GROW_INTERVAL_S)
            for slot in list(self.growing):
                target = growth_target(slot)
                if target is not None:
                    await self._grow(slot, target)

    async def _grow(self, slot: Slot, total_blocks: int) -> None:
        own = total_blocks - (slot.shared.blocks if slot.shared else 0)
        if own <= slot.blocks or slot.released:
            return
        key = ledger_key(slot.replica.id)
        with self._changing(slot.replica.id):
            try:
                await self.store.try_acquire(
                    key, slot.lease_id, own, UNLIMITED, self.keeper.ttl_s
                )
            except (StateStoreError, KvgateError) as exc:
                log.warning("could not grow a reservation on %s: %s", key, exc)
                return
            if slot.released:  # released while the store grew it: the lease must not come back
                await finish(self.release_lease(key, slot.lease_id))
                return
            self._count(slot.replica.id, own - slot.blocks)
            if slot.lower_class:
                self._count_lower(slot.replica.id, own - slot.blocks)
        slot.blocks = own
        self.metrics.reservation_growths.labels(slot.replica.pool).inc()

    async def release_lease(self, key: str, lease_id: str) -> None:
        try:
            await self.store.release(key, lease_id)
        except (StateStoreError, KvgateError) as exc:
            # The lease stops being renewed and expires within its TTL: capacity comes back.
            log.warning("could not release lease on %s (expires by TTL): %s", key, exc)

