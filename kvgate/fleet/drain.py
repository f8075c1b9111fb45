"""Drain, fleet-wide: a replica drained through one instance's admin API is drained on every
instance sharing the state store. The flag is a binding (`drain:<replica>`) that every
instance reads each discovery interval; a restart keeps it. With the memory store it is this
instance's alone. The config's `drain: true` works without the store, on every instance that
loads the file.
"""

from __future__ import annotations

import logging

from kvgate.config import CurrentConfig
from kvgate.errors import KvgateError
from kvgate.fleet.replicas import Registry, Replica
from kvgate.intervals import pause
from kvgate.state.base import StateStore, StateStoreError

log = logging.getLogger(__name__)

# A drain is meant to last until undone; the binding's TTL only bounds a forgotten one.
DRAIN_TTL_S = 30 * 24 * 3600.0


def drain_key(replica_id: str) -> str:
    return f"drain:{replica_id}"


async def set_drain(store: StateStore, replica: Replica, draining: bool) -> None:
    """Drain (or undrain) `replica` here at once, and for every instance through the store."""
    if draining:
        await store.bind(drain_key(replica.id), "admin", DRAIN_TTL_S)
    else:
        await store.unbind(drain_key(replica.id))
    replica.drain_requested = draining  # after the store: the watcher then reads the same


async def watch_drains(store: StateStore, registry: Registry, current: CurrentConfig) -> None:
    """Follow the fleet-wide drain flags, every `discovery.interval_s` of the config in force,
    until cancelled. A store that cannot be read leaves every replica as it was."""
    while True:
        for replica in registry:
            try:
                flagged = await store.lookup(drain_key(replica.id)) is not None
            except (StateStoreError, KvgateError) as exc:
                log.debug("drain flag of %s not read: %s", replica.id, exc)
                continue
            if flagged != replica.drain_requested:
                log.warning("replica %s: %s (fleet-wide)", replica.id,
                            "draining" if flagged else "undrained")
                replica.drain_requested = flagged
        await pause(lambda: current().discovery.interval_s)
