"""The routing plugin: the one seam through which a routing policy reaches a request.

For each request the router runs the plugins' hooks in this order, shaped like llm-d's
endpoint picker:

    keeps (filter) ──► score (weighted) ──► pick (a picker rule: a hold) ──► … ──► served

A plugin implements any of the four hooks; the others keep their defaults, and the router
calls only the hooks a plugin's class defines (`defines`). Its parameters are a small pydantic
model, `Params`, read from config once per config version (`settings`).

Contract, for every hook:
- who calls: the `Router`, on the event loop; `keeps`, `score` and `pick` on arrival and again
  on every placement attempt of a queued request, each time against a fresh fleet snapshot;
  `served` once per request the replica answered.
- a hook may await (the state store) but never block; it keeps no per-request state on the
  plugin (one instance serves every request, across reloads, concurrently).
- `keeps` is a per-replica verdict in the request path: cheap, and pure but for a plugin that
  documents its side effect (the breaker's trial claim).
- `score` returns one score in [0, 1] per candidate, in the candidates' order (the router
  clamps what it gets, and weighs it by `routing.scorers.<name>`). What one scorer learns of
  the request that another could use (the blocks each replica holds of the prompt) goes in
  the ranking's `Cycle`, which `pick` and `served` find on the ranking.
- `pick` may ask for a `Hold` on one candidate; `favourite` is the one replica its own scorer
  scored 1, if exactly one was (None when it did not score, or was weighted 0).
- `served` learns where the request ran (`replica_id`) and the status the replica answered
  (0: none reached kvgate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from kvgate.config import RoutingConfig
from kvgate.fleet.snapshot import Fleet, ReplicaView
from kvgate.routing.ranking import Cycle, Hold, Ranking
from kvgate.routing.route import Route

if TYPE_CHECKING:
    from kvgate.fleet.health import Breakers
    from kvgate.fleet.kv_events import KvEvents
    from kvgate.metrics import Metrics
    from kvgate.routing.sessions import Sessions

HOOKS = ("keeps", "score", "pick", "served")


class PluginParams(BaseModel):
    """A plugin's parameters: frozen, and no key it does not know."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(PluginParams):
    pass


P = TypeVar("P", bound=PluginParams)


@dataclass(frozen=True, slots=True)
class Deps:
    """What plugins may use, handed to each when the router builds it."""

    sessions: Sessions
    breakers: Breakers
    metrics: Metrics
    kv_events: KvEvents | None = None  # what each replica caches, where its events are read


class Plugin(Generic[P]):
    Params: ClassVar[type[PluginParams]] = NoParams

    def __init__(self, deps: Deps) -> None:
        self.deps = deps

    @classmethod
    def defaults(cls, config: RoutingConfig) -> dict[str, Any]:
        """Its parameters' values from the older sections of `config` (`routing.sessions`,
        `routing.load_factor`), so that a config written before plugins had parameters of
        their own means what it meant. `routing.plugins.<name>` overrides these."""
        return {}

    @classmethod
    def settings(cls, config: RoutingConfig, given: Mapping[str, Any]) -> P:
        """Its parameters under `config`: `given` (`routing.plugins.<name>`) over `defaults`.
        Raises pydantic's ValidationError, or ValueError("key: why") for a key it refuses."""
        return cls.Params.model_validate({**cls.defaults(config), **given})  # type: ignore[return-value]

    @classmethod
    def defines(cls, hook: str) -> bool:
        """Whether this plugin's class implements `hook` (one of HOOKS)."""
        return getattr(cls, hook) is not getattr(Plugin, hook)

    def keeps(self, route: Route, view: ReplicaView, params: P) -> bool:
        """Filter: may `view` take the request at all?"""
        return True

    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet, params: P,
        cycle: Cycle,
    ) -> list[float]:
        """Scorer: one score in [0, 1] per candidate, in the candidates' order."""
        return [0.0] * len(candidates)

    async def pick(
        self, route: Route, ranking: Ranking, favourite: str | None, params: P
    ) -> Hold | None:
        """Picker rule: hold the request for one of `ranking.replicas` for a while, or not."""
        return None

    async def served(
        self, route: Route, ranking: Ranking, favourite: str | None, replica_id: str,
        status: int, params: P,
    ) -> None:
        """Post-response: the request ran on `replica_id`, which answered `status`."""
