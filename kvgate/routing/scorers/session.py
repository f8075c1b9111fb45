"""A session's replica scores 1, every other 0.

The session's replica is the one it is bound to, while that replica is a candidate within its
bounded share (`kvgate.routing.bounded`); otherwise — a new session, or one whose replica is
gone or over its share — the first replica in the session key's own hash order that is within
its share. New sessions so spread evenly, and every instance sends the first turns of one
session to the same replica before any binding exists. Requests without a session key score 0
everywhere: the other scorers decide.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.config import RoutingConfig
from kvgate.routing.bounded import within_bound
from kvgate.routing.fleet import Fleet, ReplicaView
from kvgate.routing.route import Route
from kvgate.routing.scorers.prefix_affinity import preferred
from kvgate.routing.sessions import Sessions


class SessionAffinity:
    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet, config: RoutingConfig
    ) -> list[float]:
        if route.session_key is None or not candidates:
            return [0.0] * len(candidates)
        blocks = max(route.demand.blocks_on(v.replica) for v in candidates)
        bound = await self.sessions.bound(route.session_key)
        choice = next((v for v in candidates if v.id == bound), None)
        if choice is not None and not within_bound(
            choice, candidates, blocks, config.load_factor, config.load_floor
        ):
            choice = None
        if choice is None:
            choice = preferred(
                route.session_key, candidates, blocks, config.load_factor, config.load_floor
            )
        return [1.0 if choice is not None and v.id == choice.id else 0.0 for v in candidates]
