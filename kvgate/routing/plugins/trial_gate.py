"""The circuit breaker's trial, as a filter: a half-open replica is a candidate only for the
request holding its trial — the first request to claim it (`Breakers.claim`, keyed by the
route's `holder`). Claiming is this filter's side effect, undone when the request ends
(`Breakers.release`); the router runs it after every other filter, so only a request that
could go there claims a trial. A route without a holder never gets a half-open replica.
"""

from __future__ import annotations

from kvgate.fleet.health import HALF_OPEN
from kvgate.fleet.snapshot import ReplicaView
from kvgate.routing.plugin import NoParams, Plugin
from kvgate.routing.route import Route


class TrialGate(Plugin[NoParams]):
    def keeps(self, route: Route, view: ReplicaView, params: NoParams) -> bool:
        if view.circuit != HALF_OPEN:
            return True
        return route.holder is not None and self.deps.breakers.claim(view.id, route.holder)
