"""Session affinity: a session's turns go where its cache is, while that replica can take them.

- score: the session's replica scores 1, every other 0. The session's replica is the one it is
  bound to, while that replica is a candidate within its bounded share
  (`kvgate.routing.bounded`); otherwise — a new session, or one whose replica is gone or over
  its share — the first replica in the session key's own hash order within its share. New
  sessions so spread evenly, and every instance sends the first turns of one session to the
  same replica before any binding exists. A session with no replica yet whose prompt the
  replicas' KV cache events tell apart (`Route.token_ids`; some candidates hold more of it
  than others) scores 0 everywhere: where its prompt is cached beats an arbitrary hash, and the
  prefix scorer knows where that is. Requests without a session key score 0 everywhere:
  the other scorers decide.
- pick: when the replica it scored is the one the session is bound to (its cache is there),
  the request is held for that replica for `affinity_wait_s` before the others may take it.
- served: the replica that answered (any status below 500) is where the session is bound from
  now on (`Sessions.ran_on`, which counts every outcome).

Its parameters: `affinity_wait_s` and `ttl_s` from `routing.sessions` (where the config checks
the hold against every latency target), `load_factor` and `load_floor` from `routing`, which
`routing.plugins.session` may override.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field, PositiveFloat

from kvgate.config import RoutingConfig, SessionsConfig
from kvgate.fleet.snapshot import Fleet, ReplicaView
from kvgate.routing.bounded import BoundedLoad, within_bound
from kvgate.routing.plugin import Deps, Plugin
from kvgate.routing.plugins.prefix_affinity import preferred
from kvgate.routing.ranking import Cycle, Hold, Ranking
from kvgate.routing.route import Route


class SessionParams(BoundedLoad):
    affinity_wait_s: float = Field(0.25, ge=0)  # how long to wait for room on its replica
    ttl_s: PositiveFloat = 1800.0  # how long a binding lasts unused


class SessionAffinity(Plugin[SessionParams]):
    Params = SessionParams

    def __init__(self, deps: Deps) -> None:
        super().__init__(deps)
        self.sessions = deps.sessions

    @classmethod
    def settings(cls, config: RoutingConfig, given: Mapping[str, Any]) -> SessionParams:
        for key in given:
            if key in SessionsConfig.model_fields:
                raise ValueError(f"{key}: set under routing.sessions, not here")
        return super().settings(config, given)

    @classmethod
    def defaults(cls, config: RoutingConfig) -> dict[str, Any]:
        sessions = config.sessions
        return {
            **BoundedLoad.defaults(config),
            "affinity_wait_s": sessions.affinity_wait_s, "ttl_s": sessions.ttl_s,
        }

    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet,
        params: SessionParams, cycle: Cycle,
    ) -> list[float]:
        if route.session_key is None or not candidates:
            return [0.0] * len(candidates)
        blocks = max(route.demand.blocks_on(v.replica) for v in candidates)
        bound = await self.sessions.bound(route.session_key)
        choice = next((v for v in candidates if v.id == bound), None)
        if choice is not None and not within_bound(
            choice, candidates, blocks, params.load_factor, params.load_floor
        ):
            choice = None
        if choice is None and bound is None and self._placed_by_cache(route, candidates, cycle):
            return [0.0] * len(candidates)
        if choice is None:
            choice = preferred(
                route.session_key, candidates, blocks, params.load_factor, params.load_floor
            )
        return [1.0 if choice is not None and v.id == choice.id else 0.0 for v in candidates]

    def _placed_by_cache(
        self, route: Route, candidates: Sequence[ReplicaView], cycle: Cycle
    ) -> bool:
        """The replicas' KV events tell them apart for this prompt: some hold more of it."""
        events = self.deps.kv_events
        if route.token_ids is None or events is None:
            return False
        held = {cycle.cached_blocks(events, route, view) for view in candidates} - {None}
        return len(held) > 1

    async def pick(
        self, route: Route, ranking: Ranking, favourite: str | None, params: SessionParams
    ) -> Hold | None:
        if route.session_key is None or favourite is None:
            return None
        # worth waiting a moment for only where the session's cache already is
        bound = await self.sessions.bound(route.session_key)
        held = next((v for v in ranking.replicas if v.id == bound == favourite), None)
        return Hold(held, params.affinity_wait_s) if held is not None else None

    async def served(
        self, route: Route, ranking: Ranking, favourite: str | None, replica_id: str,
        status: int, params: SessionParams,
    ) -> None:
        if route.session_key is not None and 0 < status < 500:
            await self.sessions.ran_on(route.session_key, replica_id, ranking.fleet, params.ttl_s)
