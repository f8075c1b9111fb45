"""The routing stage: which replicas may take a request, and in which order to try them.

    filters ──► scorers (each in [0, 1], weighted by config) ──► picker (best first)

shaped like llm-d's endpoint picker. `rank` is called on arrival and again on every attempt
of a queued request, each time against a fresh `Fleet` snapshot, so a queued request goes
where room appears, not where it was sent when it joined. Admission tries the ranking in order
and takes the first replica whose ledger has room: the router expresses a preference, never a
promise — affinity never overrides capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvgate.config import ConfigError, RoutingConfig
from kvgate.errors import NoReplica
from kvgate.routing.fleet import Fleet, ReplicaView
from kvgate.routing.route import Route
from kvgate.routing.scorers import SCORERS, Deps, Scorer

Filter = Callable[[Route, ReplicaView], bool]


def routable(route: Route, view: ReplicaView) -> bool:
    """Healthy by the active checks, circuit not open, not draining."""
    return view.routable


def serves_model(route: Route, view: ReplicaView) -> bool:
    return route.demand.model in view.models


def fits_context(route: Route, view: ReplicaView) -> bool:
    limit = view.max_model_len(route.demand.model)
    return limit is None or route.demand.worst_tokens <= limit


def not_failed_before(route: Route, view: ReplicaView) -> bool:
    """A retried request goes elsewhere."""
    return view.id not in route.exclude


FILTERS: tuple[Filter, ...] = (routable, serves_model, fits_context, not_failed_before)


@dataclass(frozen=True, slots=True)
class Ranking:
    replicas: list[ReplicaView]  # best first
    # The replica the session is bound to, when it is still the session's choice: admission
    # waits up to sessions.affinity_wait_s for room there before trying the others.
    sticky: ReplicaView | None = None
    hold_s: float = 0.0
    # scorer name -> the one replica it scored 1 (the session's, the prefix's), for metrics
    favourites: Mapping[str, str] = field(default_factory=dict)
    fleet: Fleet | None = None  # the snapshot it was ranked against

    def usable(self, waited_s: float) -> list[ReplicaView]:
        """The replicas a request that has waited `waited_s` may be placed on now: only its
        session's replica during the hold, then all of them in order; never one that is busy
        (vLLM's queue limits refused it lately; a busy session replica ends the hold at once)."""
        if self.sticky is not None and waited_s < self.hold_s and not self.sticky.busy:
            return [self.sticky]
        if not any(view.busy for view in self.replicas):
            return self.replicas
        return [view for view in self.replicas if not view.busy]


def check_scorers(names: Mapping[str, float]) -> None:
    """Raises ConfigError naming every scorer the routing config asks for that does not exist:
    a config is refused for it at start and on reload, never found out by a request."""
    unknown = sorted(set(names) - set(SCORERS))
    if unknown:
        raise ConfigError([
            f"routing.scorers.{name}: unknown scorer (known: {', '.join(sorted(SCORERS))})"
            for name in unknown
        ])


class Router:
    """Ranks with the scorers the request's own routing config names (`rank`'s `config`), so a
    reload never changes a ranking under a request in flight. Each scorer is built the first
    time a config names it and kept across reloads, with its state (round robin's turn)."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self._scorers: dict[str, Scorer] = {}

    @staticmethod
    def pool(model: str, chain: Sequence[str], fleet: Fleet) -> str:
        """The first pool along the overflow chain with a routable replica serving `model`."""
        for pool in chain:
            if any(v.routable and model in v.models for v in fleet.in_pool(pool)):
                return pool
        raise NoReplica(f"no healthy replica in pool {chain[0]!r} serves model {model!r}")

    async def rank(self, route: Route, fleet: Fleet, config: RoutingConfig) -> Ranking:
        candidates = [
            v for v in fleet.in_pool(route.demand.pool) if all(f(route, v) for f in FILTERS)
        ]
        if not candidates:
            return Ranking([], fleet=fleet)
        totals = [0.0] * len(candidates)
        sticky = None
        favourites = {}
        for name, weight in config.scorers.items():
            if not weight:
                continue
            scorer = self._scorers.get(name)
            if scorer is None:  # names were checked with the config (check_scorers)
                scorer = self._scorers[name] = SCORERS[name](self.deps)
            scores = await scorer.score(route, candidates, fleet, config)
            for i, value in enumerate(scores):
                totals[i] += weight * min(1.0, max(0.0, value))
            top = [v for v, s in zip(candidates, scores, strict=True) if s >= 1]
            if len(top) == 1:
                favourites[name] = top[0].id
        if route.session_key is not None and "session" in favourites:
            # worth waiting a moment for only where the session's cache already is
            bound = await self.deps.sessions.bound(route.session_key)
            sticky = next((v for v in candidates if v.id == bound == favourites["session"]), None)
        order = sorted(
            range(len(candidates)),
            key=lambda i: (-totals[i], candidates[i].load, candidates[i].id),
        )
        hold = config.sessions.affinity_wait_s if sticky is not None else 0.0
        return Ranking([candidates[i] for i in order], sticky, hold, favourites, fleet)
