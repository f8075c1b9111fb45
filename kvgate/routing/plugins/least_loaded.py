"""Most ledger headroom first; among equals, the shorter scraped vLLM waiting queue."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.fleet.snapshot import Fleet, ReplicaView
from kvgate.routing.plugin import NoParams, Plugin
from kvgate.routing.ranking import Cycle
from kvgate.routing.route import Route

QUEUE_SHARE = 0.1  # the part of the score the waiting queue decides


class LeastLoaded(Plugin[NoParams]):
    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet, params: NoParams,
        cycle: Cycle,
    ) -> list[float]:
        return [
            (1 - QUEUE_SHARE) * (1 - view.load) + QUEUE_SHARE / (1 + (view.waiting or 0.0))
            for view in candidates
        ]
