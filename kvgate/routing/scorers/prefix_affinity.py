"""Requests sharing a prompt prefix meet on few replicas, without overloading one: consistent
hashing with bounded load (Mirrokni, Thorup and Zadimoghaddam, 2018).

Each prefix orders the candidates by rendezvous hash — the same order on every instance, and
only the prefixes of a replica that leaves or joins move. The first replica in that order
whose reserved blocks, with this request's, stay within (1 + load_factor) × its fair share
(the pool's reserved blocks, this request's included, weighted by capacity) scores 1; a
replica under `free_below` of its admissible blocks always has room. The rest score 0, as do
all candidates of a request with no prefix key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvgate.config import RoutingConfig
from kvgate.routing.fleet import Fleet, ReplicaView
from kvgate.routing.route import Route


def hash_order(prefix: str, candidates: Sequence[ReplicaView]) -> list[ReplicaView]:
    def weight(view: ReplicaView) -> bytes:
        return hashlib.blake2b(f"{prefix}\0{view.id}".encode(), digest_size=8).digest()

    return sorted(candidates, key=weight, reverse=True)


def preferred(
    prefix: str, candidates: Sequence[ReplicaView], blocks: int, config: RoutingConfig
) -> ReplicaView | None:
    """The replica the prefix should go to now, if any has room within the bound."""
    known = [v for v in candidates if v.admissible_blocks]
    capacity = sum(v.admissible_blocks or 0 for v in known)
    if not capacity:
        return None
    total = sum(v.reserved_blocks for v in known) + blocks
    bound = config.prefix_affinity
    for view in hash_order(prefix, known):
        admissible = view.admissible_blocks or 0
        fair = total * admissible / capacity
        after = view.reserved_blocks + blocks
        if after <= (1 + bound.load_factor) * fair or after <= bound.free_below * admissible:
            return view
    return None


class PrefixAffinity:
    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet, config: RoutingConfig
    ) -> list[float]:
        if route.prefix is None:
            return [0.0] * len(candidates)
        blocks = max((route.demand.blocks_on(v.replica) for v in candidates), default=0)
        choice = preferred(route.prefix, candidates, blocks, config)
        return [1.0 if choice is not None and view.id == choice.id else 0.0 for view in candidates]
