"""Each request prefers the next replica in turn (by id), then the ones after it."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.fleet.snapshot import Fleet, ReplicaView
from kvgate.routing.plugin import Deps, NoParams, Plugin
from kvgate.routing.ranking import Cycle
from kvgate.routing.route import Route


class RoundRobin(Plugin[NoParams]):
    def __init__(self, deps: Deps) -> None:
        super().__init__(deps)
        self._turn = 0

    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet, params: NoParams,
        cycle: Cycle,
    ) -> list[float]:
        n = len(candidates)
        if not n:
            return []
        ids = sorted(view.id for view in candidates)
        first = self._turn % n
        self._turn += 1
        place = {rid: (i - first) % n for i, rid in enumerate(ids)}
        return [1 - place[view.id] / n for view in candidates]
