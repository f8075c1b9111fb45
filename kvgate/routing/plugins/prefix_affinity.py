"""Requests sharing a prompt prefix meet on few replicas, without overloading one: consistent
hashing with bounded load (Mirrokni, Thorup and Zadimoghaddam, 2018); and where the replicas'
KV cache events say what each one holds, the replicas that hold the most of the prompt.

**Precise**, when the request's token ids are known exactly (`Route.token_ids`: a chat
rendered with the model's template, or one completions prompt) and some candidate has a
KV-event index (`kvgate.fleet.kv_events`): each candidate within its bounded share
(`kvgate.routing.bounded`) scores the leading blocks of the prompt it holds — or is about to:
prompts sent there in the last seconds count before their events arrive — over the most any
candidate holds (1 for the best); a replica beyond its share scores 0, whatever it holds. A
prompt no candidate holds any block of falls through to the fingerprint, so that it still
lands where the next request like it will look.

**Fingerprint** otherwise: each prefix (the normalized system prompt and tools) orders the
candidates by rendezvous hash — the same order on every instance, and only the prefixes of a
replica that leaves or joins move. The first replica in that order within its bounded share
scores 1; the rest score 0, as do all candidates of a request with no prefix key.

Once served, a request with a prefix key is counted in `kvgate_prefix_routes_total` by
whether it ran on its favourite ("preferred") or not ("elsewhere").
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

from kvgate.config import RoutingConfig
from kvgate.fleet.snapshot import Fleet, ReplicaView
from kvgate.routing.bounded import BoundedLoad, within_bound
from kvgate.routing.plugin import Plugin
from kvgate.routing.ranking import Cycle, Ranking
from kvgate.routing.route import Route


def hash_order(prefix: str, candidates: Sequence[ReplicaView]) -> list[ReplicaView]:
    return [candidates[i] for i in _order(prefix, tuple(v.id for v in candidates))]


@functools.lru_cache(maxsize=8192)
def _order(prefix: str, ids: tuple[str, ...]) -> tuple[int, ...]:
    """Positions in `ids` by descending rendezvous weight. Remembered: a prefix (a session)
    meets the same candidates request after request, and hashing each of them every time
    was most of a request's ranking on a large pool."""

    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{prefix}\0{ids[i]}".encode(), digest_size=8).digest()

    return tuple(sorted(range(len(ids)), key=weight, reverse=True))


def preferred(
    prefix: str,
    candidates: Sequence[ReplicaView],
    blocks: int,
    load_factor: float,
    floor: float = 0.0,
) -> ReplicaView | None:
    """The replica the prefix should go to now: the first in its order within the bound."""
    for view in hash_order(prefix, candidates):
        if within_bound(view, candidates, blocks, load_factor, floor):
            return view
    return None


class PrefixAffinity(Plugin[BoundedLoad]):
    Params = BoundedLoad

    @classmethod
    def defaults(cls, config: RoutingConfig) -> dict[str, Any]:
        return BoundedLoad.defaults(config)

    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet, params: BoundedLoad,
        cycle: Cycle,
    ) -> list[float]:
        blocks = max((route.demand.blocks_on(v.replica) for v in candidates), default=0)
        precise = self._precise(route, candidates, blocks, params, cycle)
        if precise is not None:
            return precise
        if route.prefix is None:
            return [0.0] * len(candidates)
        choice = preferred(
            route.prefix, candidates, blocks, params.load_factor, params.load_floor
        )
        return [1.0 if choice is not None and view.id == choice.id else 0.0 for view in candidates]

    def _precise(
        self, route: Route, candidates: Sequence[ReplicaView], blocks: int, params: BoundedLoad,
        cycle: Cycle,
    ) -> list[float] | None:
        """Scores by cached leading blocks; None where they do not apply or none is held."""
        events = self.deps.kv_events
        if route.token_ids is None or events is None:
            return None
        held: list[int] = []
        known = False
        for view in candidates:
            cached = cycle.cached_blocks(events, route, view)
            known = known or cached is not None
            if cached is None or not within_bound(
                view, candidates, blocks, params.load_factor, params.load_floor
            ):
                cached = 0
            held.append(cached)
        if not known:
            return None
        best = max(held)
        if best == 0:
            return None
        return [h / best for h in held]

    async def served(
        self, route: Route, ranking: Ranking, favourite: str | None, replica_id: str,
        status: int, params: BoundedLoad,
    ) -> None:
        """Did the request's prefix get its replica?"""
        if route.prefix is not None:
            where = "preferred" if favourite == replica_id else "elsewhere"
            self.deps.metrics.prefix_routes.labels(route.demand.pool, where).inc()

