"""Scorers: each rates the candidate replicas for one request, every score in [0, 1].

The router sums the scores with the weights of `routing.scorers` in config and tries the
replicas best first. A scorer is one small file and one line in `SCORERS`; it gets what it
needs from `Deps` when the router is built. Scorers are called on the event loop, once per
placement attempt (a queued request is ranked again on every attempt); they may await (the
session scorer reads the state store) but must not block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate.config import RoutingConfig
from kvgate.routing.fleet import Fleet, ReplicaView
from kvgate.routing.route import Route
from kvgate.routing.scorers.least_loaded import LeastLoaded
from kvgate.routing.scorers.prefix_affinity import PrefixAffinity
from kvgate.routing.scorers.round_robin import RoundRobin
from kvgate.routing.scorers.session import SessionAffinity
from kvgate.routing.sessions import Sessions


class Scorer(Protocol):
    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet, config: RoutingConfig
    ) -> list[float]:
        """One score in [0, 1] per candidate, in the candidates' order."""
        ...


@dataclass(frozen=True, slots=True)
class Deps:
    sessions: Sessions


SCORERS: dict[str, Callable[[Deps], Scorer]] = {
    "least_loaded": lambda deps: LeastLoaded(),
    "round_robin": lambda deps: RoundRobin(),
    "prefix_affinity": lambda deps: PrefixAffinity(),
    "session": lambda deps: SessionAffinity(deps.sessions),
}
