"""The routing stage: which replicas may take a request, and in which order to try them.

    filters ──► scorers (each in [0, 1], weighted by config) ──► picker (best first, holds)
            └── after the response: served

shaped like llm-d's endpoint picker. Everything but the fixed eligibility filters below is a
plugin (`kvgate.routing.plugin`, registered in `kvgate.routing.plugins`). `rank` is called on
arrival and again on every attempt of a queued request, each time against a fresh `Fleet`
snapshot, so a queued request goes where room appears, not where it was sent when it joined.
Admission tries `Ranking.usable` in order and takes the first replica whose ledger has room:
the router expresses a preference, never a promise — affinity never overrides capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from kvgate.config import ConfigError, RoutingConfig
from kvgate.errors import NoReplica
from kvgate.fleet.snapshot import Fleet, ReplicaView
from kvgate.routing.plugin import Deps, Plugin
from kvgate.routing.plugins import ALWAYS, PluginTable, loaded, registry
from kvgate.routing.ranking import Cycle, Ranking
from kvgate.routing.route import Route

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


# what makes a replica eligible at all, before any plugin's filter
FILTERS: tuple[Filter, ...] = (routable, serves_model, fits_context, not_failed_before)

PLANS_KEPT = 8  # config versions whose plan is remembered (requests in flight over reloads)


@dataclass(frozen=True, slots=True)
class Step:
    """One plugin as one config version uses it."""

    name: str
    plugin: Plugin[Any]
    params: Any
    weight: float


@dataclass(frozen=True, slots=True)
class Plan:
    """The hooks one config version runs, each in config order."""

    filters: tuple[Step, ...]
    scorers: tuple[Step, ...]  # weighted above 0
    pickers: tuple[Step, ...]
    served: tuple[Step, ...]


def configured(config: RoutingConfig) -> list[str]:
    """The plugins `config` names: its scorers, then those with parameters only."""
    return [*config.scorers, *(name for name in config.plugins if name not in config.scorers)]


def check_routing(config: RoutingConfig, plugins: PluginTable | None = None) -> None:
    """Raises ConfigError naming, by key path, every plugin the routing config asks for that
    does not exist or cannot be loaded, every scorer weight given to a plugin that does not
    score, and every parameter its plugin refuses: a config is refused for it at start and
    on reload, never found out by a request. `plugins`: those it may name (None: the
    registry's, `kvgate.routing.plugins.registry`)."""
    if plugins is None:
        try:
            plugins = registry(configured(config))
        except ValueError as exc:
            raise ConfigError([f"routing: {exc}"]) from None
    scoring = sorted(name for name, cls in plugins.items() if cls.defines("score"))
    problems = []
    for name in config.scorers:
        if name not in plugins:
            problems.append(f"routing.scorers.{name}: unknown scorer (known: {', '.join(scoring)})")
        elif not plugins[name].defines("score"):
            problems.append(f"routing.scorers.{name}: this plugin does not score")
    for name, given in config.plugins.items():
        if name not in plugins:
            problems.append(
                f"routing.plugins.{name}: unknown plugin (known: {', '.join(sorted(plugins))})"
            )
            continue
        try:
            plugins[name].settings(config, given)
        except ValidationError as exc:
            problems.extend(
                f"routing.plugins.{'.'.join(map(str, (name, *e['loc'])))}: {e['msg']}"
                for e in exc.errors()
            )
        except ValueError as exc:  # a plugin's own refusal: "key: why"
            problems.append(f"routing.plugins.{name}.{exc}")
    if problems:
        raise ConfigError(problems)


class Router:
    """Ranks with the plugins the request's own routing config names (`rank`'s `config`), so a
    reload never changes a ranking under a request in flight. Each plugin is built the first
    time a config names it and kept across reloads, with its state (round robin's turn); its
    parameters are read once per config version."""

    def __init__(self, deps: Deps, plugins: PluginTable | None = None) -> None:
        self.deps = deps
        self.plugins = plugins  # None: the registry's (each config was checked, so loaded)
        self._built: dict[str, Plugin[Any]] = {}
        self._plans: dict[int, tuple[RoutingConfig, Plan]] = {}

    def check(self, config: RoutingConfig) -> None:
        """`check_routing` against this router's plugins."""
        check_routing(config, self.plugins)

    @staticmethod
    def pool(model: str, chain: Sequence[str], fleet: Fleet) -> str:
        """The first pool along the overflow chain with a routable replica serving `model`."""
        for pool in chain:
            if any(v.routable and model in v.models for v in fleet.in_pool(pool)):
                return pool
        raise NoReplica(f"no healthy replica in pool {chain[0]!r} serves model {model!r}")

    async def rank(self, route: Route, fleet: Fleet, config: RoutingConfig) -> Ranking:
        plan = self.plan(config)
        candidates = [v for v in fleet.in_pool(route.demand.pool) if self.keeps(plan, route, v)]
        if not candidates:
            return Ranking([], fleet=fleet)
        totals = [0.0] * len(candidates)
        cycle = Cycle()
        for step in plan.scorers:
            scores = await step.plugin.score(route, candidates, fleet, step.params, cycle)
            for i, value in enumerate(scores):
                totals[i] += step.weight * min(1.0, max(0.0, value))
            top = [v for v, s in zip(candidates, scores, strict=True) if s >= 1]
            if len(top) == 1:
                cycle.favourites[step.name] = top[0].id
        order = sorted(
            range(len(candidates)),
            key=lambda i: (-totals[i], candidates[i].load, candidates[i].id),
        )
        ranking = Ranking([candidates[i] for i in order], cycle=cycle, fleet=fleet)
        for step in plan.pickers:
            favourite = cycle.favourites.get(step.name)
            hold = await step.plugin.pick(route, ranking, favourite, step.params)
            if hold is not None:
                return replace(ranking, hold=hold)
        return ranking

    async def served(
        self, route: Route, ranking: Ranking, replica_id: str, config: RoutingConfig,
        status: int,
    ) -> None:
        """The request ranked by `ranking` (its last) ran on `replica_id`, which answered
        `status` (0: no answer reached kvgate): every plugin of `config` hears of it."""
        for step in self.plan(config).served:
            await step.plugin.served(
                route, ranking, ranking.cycle.favourites.get(step.name), replica_id, status,
                step.params,
            )

    @staticmethod
    def keeps(plan: Plan, route: Route, view: ReplicaView) -> bool:
        """Every filter keeps `view` for the route: the fixed ones, then the plugins'. Loops,
        not all() over generators: this runs for every replica on every ranking."""
        for keep in FILTERS:
            if not keep(route, view):
                return False
        for step in plan.filters:  # noqa: SIM110
            if not step.plugin.keeps(route, view, step.params):
                return False
        return True

    def plan(self, config: RoutingConfig) -> Plan:
        """The hooks `config` runs (names and parameters were checked with the config,
        `check_routing`)."""
        kept = self._plans.get(id(config))
        if kept is not None and kept[0] is config:
            return kept[1]
        table = self.plugins if self.plugins is not None else loaded()  # checked: loaded
        steps = [self._step(name, table, config) for name in configured(config)]
        always = [self._step(name, ALWAYS, config) for name in ALWAYS]
        plan = Plan(
            filters=tuple(s for s in [*steps, *always] if s.plugin.defines("keeps")),
            scorers=tuple(s for s in steps if s.weight and s.plugin.defines("score")),
            pickers=tuple(s for s in steps if s.plugin.defines("pick")),
            served=tuple(s for s in steps if s.plugin.defines("served")),
        )
        if len(self._plans) >= PLANS_KEPT:
            self._plans.clear()  # bounded; each config's plan is built again on its next use
        self._plans[id(config)] = (config, plan)
        return plan

    def _step(self, name: str, table: PluginTable, config: RoutingConfig) -> Step:
        plugin = self._built.get(name)
        if plugin is None:
            plugin = self._built[name] = table[name](self.deps)
        params = type(plugin).settings(config, config.plugins.get(name, {}))
        return Step(name, plugin, params, config.scorers.get(name, 0.0))
