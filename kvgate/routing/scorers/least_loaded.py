"""Most ledger headroom first; among equals, the shorter scraped vLLM waiting queue."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.config import RoutingConfig
from kvgate.routing.fleet import Fleet, ReplicaView
from kvgate.routing.route import Route

QUEUE_SHARE = 0.1  # the part of the score the waiting queue decides


class LeastLoaded:
    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet, config: RoutingConfig
    ) -> list[float]:
        return [
            (1 - QUEUE_SHARE) * (1 - view.load) + QUEUE_SHARE / (1 + (view.waiting or 0.0))
            for view in candidates
        ]
