"""The block ledger: what this instance has reserved on each replica's ledger in the state
store, as leases, and the arithmetic of sharing a prompt's prefix.

`reserve` takes a request's blocks on one replica (and, first of its prefix there, the prefix's
blocks as a lease of their own) within a limit, or says there is no room; `give_back` returns
all of it. Every step that takes a lease cannot leak it: cancelled while the store works, a
lease granted anyway is released before the cancellation goes on (`kvgate.protect.acquire`);
the caller releases a slot as one protected unit (`kvgate.protect.finish`). Predicted
reservations grow with their answers (`grow`). `reserved` is this instance's view of every
ledger — the store's figure plus what is being acquired now — for routing and the gauges.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from kvgate.demand import Demand, Slot, growth_target, ledger_key
from kvgate.errors import KvgateError
from kvgate.leases import LeaseKeeper
from kvgate.metrics import Metrics
from kvgate.protect import acquire, finish, together
from kvgate.replicas import Replica
from kvgate.shared_prefix import SharedPrefix, SharedPrefixes
from kvgate.state.base import StateStore, StateStoreError

log = logging.getLogger(__name__)

# How often predicted reservations are checked against what their answers have written.
GROW_INTERVAL_S = 0.05
# Growth is forced: the request already runs, and the ledger must show what it holds.
UNLIMITED = 1 << 40


class Ledger:
    def __init__(self, store: StateStore, keeper: LeaseKeeper, metrics: Metrics) -> None:
        self.store = store
        self.keeper = keeper
        self.metrics = metrics
        self.reserved: dict[str, int] = {}  # last known ledger totals, for ordering and metrics
        self._pending: dict[str, int] = {}  # blocks being acquired now, per replica
        self.prefixes = SharedPrefixes()
        self.growing: set[Slot] = set()  # admitted predicted reservations, grown as they run

    async def reserve(
        self,
        replica: Replica,
        demand: Demand,
        limit: int,
        ttl: float,
        on_stale: Callable[[Slot], Awaitable[None]],
    ) -> Slot | None:
        """Reserve on one replica, within `limit` blocks: the request's own blocks, plus (first
        of its prefix here) the shared prefix's blocks as a lease of their own. None: no room.
        `on_stale` releases the slot if its request holds it past `demand.max_hold_s`."""
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
                    live, own_granted = await self._acquire_both(
                        replica.id, shared.lease_id, prefix_blocks, lease_id, own_later,
                        limit, ttl,
                    )
                    if live:
                        self.prefixes.granted(shared)
                finally:
                    if not shared.live:
                        self.prefixes.drop(shared)  # refused, failed or cancelled
                if not shared.live:
                    return None
                self.keeper.add(key, shared.lease_id, ttl_s=ttl)  # while requests share it
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
            key, lease_id, max_age_s=demand.max_hold_s, on_stale=lambda: on_stale(slot), ttl_s=ttl,
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
        await self.release_lease(key, shared.lease_id)

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
                await self.release_lease(key, lease_id)

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
                self.release_lease(key, lease) for got, lease in ((prefix, prefix_id), (mine, own_id))
                if got is True
            ))  # fmt: skip
            if failed is not None:
                raise failed
            return False, False

        async def undo(granted: tuple[bool, bool]) -> None:
            await together(*(
                self.release_lease(key, lease)
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

    async def give_back(self, slot: Slot) -> None:
        """Release the slot's lease and its share of the prefix, together (one round trip
        with a pipelining store). Run it through `finish`: it must not be cut short."""
        self.growing.discard(slot)
        key = ledger_key(slot.replica.id)
        self.keeper.discard(key, slot.lease_id)
        self._count(slot.replica.id, -slot.blocks)
        for outcome in await together(
            self.release_lease(key, slot.lease_id),
            None if slot.shared is None else self._unshare(slot.shared),
        ):
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
        slot.blocks = own
        self.metrics.reservation_growths.labels(slot.replica.pool).inc()

    async def release_lease(self, key: str, lease_id: str) -> None:
        try:
            await self.store.release(key, lease_id)
        except (StateStoreError, KvgateError) as exc:
            # The lease stops being renewed and expires within its TTL: capacity comes back.
            log.warning("could not release lease on %s (expires by TTL): %s", key, exc)

