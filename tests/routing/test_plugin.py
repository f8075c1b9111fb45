"""The plugin seam: every registered plugin keeps the contract, and a plugin written outside
kvgate is loaded by name (an installed package's entry point, or its `module:Class`), or
handed to the router in a table."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from pydantic import Field

from kvgate.config import ConfigError, RoutingConfig
from kvgate.fleet.snapshot import Fleet, ReplicaView
from kvgate.routing.plugin import Plugin, PluginParams
from kvgate.routing.plugins import PLUGINS
from kvgate.routing.ranking import Cycle, Hold, Ranking
from kvgate.routing.route import Route
from kvgate.routing.router import Router, check_routing
from tests.routing.fleets import deps, fleet, replica, route


@pytest.mark.parametrize("name", sorted(PLUGINS))
async def test_every_registered_scorer_scores_within_0_and_1(name):
    plugin = PLUGINS[name](deps())
    if not plugin.defines("score"):
        pytest.skip(f"{name} does not score")
    f = fleet(replica("a"), replica("b", waiting=100), replica("c"),
              reserved={"a": 1000, "b": 0, "c": 5000})
    params = type(plugin).settings(RoutingConfig(), {})
    scores = await plugin.score(route(session="s", prefix="x"), list(f), f, params, Cycle())
    assert len(scores) == 3 and all(0 <= s <= 1 for s in scores)


class NearestParams(PluginParams):
    zone: str = "z1"
    hold_s: float = Field(0.0, ge=0)


class Nearest(Plugin[NearestParams]):
    """A test's own plugin: replicas named after its zone only, the last in name order
    scoring best, held for `hold_s`; it remembers where requests were served."""

    Params = NearestParams

    def __init__(self, deps: object) -> None:
        super().__init__(deps)  # type: ignore[arg-type]
        self.served_on: list[tuple[str, int]] = []

    def keeps(self, route: Route, view: ReplicaView, params: NearestParams) -> bool:
        return view.id.startswith(params.zone)

    async def score(
        self, route: Route, candidates: Sequence[ReplicaView], fleet: Fleet,
        params: NearestParams, cycle: Cycle,
    ) -> list[float]:
        last = max(v.id for v in candidates)
        return [1.0 if v.id == last else 0.0 for v in candidates]

    async def pick(
        self, route: Route, ranking: Ranking, favourite: str | None, params: NearestParams
    ) -> Hold | None:
        held = next(v for v in ranking.replicas if v.id == favourite)
        return Hold(held, params.hold_s) if params.hold_s else None

    async def served(
        self, route: Route, ranking: Ranking, favourite: str | None, replica_id: str,
        status: int, params: NearestParams,
    ) -> None:
        self.served_on.append((replica_id, status))


async def test_a_plugin_written_outside_kvgate_is_registered_and_ranks():
    router = Router(deps(), {**PLUGINS, "nearest": Nearest})
    config = RoutingConfig(
        scorers={"nearest": 1, "least_loaded": 0.1},
        plugins={"nearest": {"zone": "z2", "hold_s": 0.5}},
    )
    router.check(config)
    f = fleet(replica("z1-a"), replica("z2-a"), replica("z2-b"), reserved={"z2-b": 500})
    ranking = await router.rank(route(), f, config)
    assert [v.id for v in ranking.replicas] == ["z2-b", "z2-a"]
    assert ranking.hold == Hold(ranking.replicas[0], 0.5)
    assert [v.id for v in ranking.usable(0.1)] == ["z2-b"]
    await router.served(route(), ranking, "z2-b", config, 200)
    assert router.plan(config).served[-1].plugin.served_on == [("z2-b", 200)]


def test_a_plugin_outside_the_table_is_refused_and_its_parameters_are_checked():
    config = RoutingConfig(plugins={"nearest": {"zone": 3}})
    with pytest.raises(ConfigError, match=r"routing\.plugins\.nearest: unknown plugin"):
        check_routing(config)
    with pytest.raises(ConfigError, match=r"routing\.plugins\.nearest\.zone"):
        check_routing(config, {**PLUGINS, "nearest": Nearest})


def test_a_weight_for_a_plugin_that_does_not_score_is_refused():
    class Gate(Plugin[PluginParams]):
        def keeps(self, route: Route, view: ReplicaView, params: PluginParams) -> bool:
            return True

    with pytest.raises(ConfigError, match=r"routing\.scorers\.gate: this plugin does not score"):
        check_routing(RoutingConfig(scorers={"gate": 1}), {**PLUGINS, "gate": Gate})


async def ranked_by_nearest(config: RoutingConfig) -> list[str]:
    """What a router with only the registry's plugins ranks under `config` (checked first,
    off the loop, as a config is loaded: it reads the installed packages' metadata)."""
    await asyncio.to_thread(check_routing, config)
    router = Router(deps())
    f = fleet(replica("z1-a"), replica("z2-a"), replica("z2-b"))
    return [v.id for v in (await router.rank(route(), f, config)).replicas]


async def test_a_plugin_from_outside_is_loaded_by_its_module_and_class():
    name = "tests.routing.test_plugin:Nearest"
    config = RoutingConfig(scorers={name: 1}, plugins={name: {"zone": "z2"}})
    assert await ranked_by_nearest(config) == ["z2-b", "z2-a"]


def installed(directory: Path) -> None:
    """A distribution in `directory` declaring `nearest` under `kvgate.routing_plugins`, as
    `pip install` of a package with that entry point leaves it."""
    info = directory / "kvgate_nearest-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvgate-nearest\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[kvgate.routing_plugins]\nnearest = tests.routing.test_plugin:Nearest\n")


async def test_an_installed_packages_plugin_is_named_by_its_entry_point(tmp_path, monkeypatch):
    await asyncio.to_thread(installed, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = RoutingConfig(scorers={"nearest": 1}, plugins={"nearest": {"zone": "z2"}})
    assert await ranked_by_nearest(config) == ["z2-b", "z2-a"]


@pytest.mark.parametrize(("name", "why"), [
    ("tests.routing.no_such_module:Mine", r"cannot be loaded \(No module named"),
    ("tests.routing.test_plugin:Missing", r"cannot be loaded \(module .* has no attribute"),
    ("tests.routing.test_plugin:route", r"<function route .*> is not a routing plugin"),
])  # fmt: skip
def test_a_plugin_that_cannot_be_loaded_refuses_the_config_saying_why(name, why):
    with pytest.raises(ConfigError, match=rf"routing: {re.escape(name)}: {why}"):
        check_routing(RoutingConfig(scorers={name: 1}))
