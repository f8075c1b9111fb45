"""The replica a request's session is bound to scores 1, every other 0. Requests without a
session key, or whose session is unbound, score 0 everywhere (the other scorers decide)."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.config import RoutingConfig
from kvgate.routing.fleet import Fleet, ReplicaView
from kvgate.routing.route import Route
from kvgate.routing.sessions import Sessions


class SessionAffinity:
    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet, config: RoutingConfig
    ) -> list[float]:
        if route.session_key is None:
            return [0.0] * len(candidates)
        bound = await self.sessions.bound(route.session_key)
        return [1.0 if view.id == bound else 0.0 for view in candidates]
