"""The router on hand-made fleet snapshots: filters, the weighted sum, the picker, pools,
config checks, and the post-response hook."""

from __future__ import annotations

import pytest

from kvgate.config import ConfigError, RoutingConfig
from kvgate.errors import NoReplica
from kvgate.metrics import Metrics
from kvgate.routing.router import (
    FILTERS,
    Router,
    check_routing,
    fits_context,
    not_failed_before,
    routable,
)
from kvgate.routing.sessions import Sessions
from kvgate.state.memory import MemoryStore
from tests.routing.fleets import deps, fleet, replica, route


def router(store: MemoryStore | None = None, metrics: Metrics | None = None) -> Router:
    return Router(deps(store, metrics))


def test_routable_excludes_unhealthy_draining_and_circuit_open_replicas():
    f = fleet(replica("ok"), replica("sick", healthy=False), replica("drained", drain=True),
              replica("ejected"), replica("trial"),
              circuits={"ejected": "open", "trial": "half_open"})
    assert [v.id for v in f if routable(route(), v)] == ["ok", "trial"]


def test_fits_context_excludes_replicas_whose_context_is_too_short():
    f = fleet(replica("short", max_model_len=1000), replica("long", max_model_len=100_000))
    assert [v.id for v in f if fits_context(route(tokens=5000), v)] == ["long"]


def test_a_retried_request_skips_the_replica_that_failed_it():
    f = fleet(replica("a"), replica("b"))
    assert [v.id for v in f if not_failed_before(route(exclude=frozenset({"a"})), v)] == ["b"]


async def test_rank_applies_every_filter_then_orders_by_weighted_score():
    config = RoutingConfig(scorers={"least_loaded": 1})
    f = fleet(replica("busy"), replica("idle"), replica("other-model", model="x"),
              replica("sick", healthy=False), reserved={"busy": 900})
    ranking = await router().rank(route(), f, config)
    assert [v.id for v in ranking.replicas] == ["idle", "busy"]
    assert ranking.hold is None
    assert len(FILTERS) == 4


async def test_a_bound_session_outweighs_load_and_is_held_for_its_affinity_wait():
    store = MemoryStore()
    await store.bind(Sessions.store_key("chat-1"), "busy", 60)
    config = RoutingConfig()
    # busier, but within 1.25 × its half of the 510 blocks the pool would hold
    f = fleet(replica("busy"), replica("idle"), reserved={"busy": 300, "idle": 200})
    ranking = await router(store).rank(route(session="chat-1"), f, config)
    assert [v.id for v in ranking.replicas] == ["busy", "idle"]
    assert ranking.hold is not None and ranking.hold.replica.id == "busy"
    assert ranking.hold.for_s == config.sessions.affinity_wait_s
    assert ranking.cycle.favourites["session"] == "busy"


async def test_a_session_whose_replica_is_over_its_bounded_share_goes_elsewhere():
    store = MemoryStore()
    await store.bind(Sessions.store_key("chat-1"), "hot", 60)
    config = RoutingConfig()
    f = fleet(replica("hot"), replica("cool"), reserved={"hot": 700, "cool": 100})
    ranking = await router(store).rank(route(session="chat-1"), f, config)
    assert [v.id for v in ranking.replicas] == ["cool", "hot"]
    assert ranking.hold is None


async def test_a_session_bound_to_a_drained_replica_goes_elsewhere():
    store = MemoryStore()
    await store.bind(Sessions.store_key("chat-1"), "old", 60)
    config = RoutingConfig()
    f = fleet(replica("old", drain=True), replica("new"))
    ranking = await router(store).rank(route(session="chat-1"), f, config)
    assert [v.id for v in ranking.replicas] == ["new"]
    assert ranking.hold is None


async def test_round_robin_alone_takes_turns():
    config = RoutingConfig(scorers={"round_robin": 1})
    r = router()
    f = fleet(replica("a"), replica("b"))
    firsts = [(await r.rank(route(), f, config)).replicas[0].id for _ in range(4)]
    assert firsts == ["a", "b", "a", "b"]


async def test_no_candidate_is_an_empty_ranking_not_an_error():
    config = RoutingConfig()
    f = fleet(replica("sick", healthy=False))
    assert (await router().rank(route(), f, config)).replicas == []


def test_pool_follows_the_overflow_chain_to_one_with_a_routable_replica():
    f = fleet(replica("l", pool="long", healthy=False), replica("d", pool="default"))
    assert Router.pool("m", ["long", "default"], f) == "default"
    with pytest.raises(NoReplica):
        Router.pool("m", ["long"], f)
    with pytest.raises(NoReplica):
        Router.pool("unknown-model", ["long", "default"], f)


def test_an_unknown_scorer_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"routing\.scorers\.nearest"):
        check_routing(RoutingConfig(scorers={"nearest": 1}))


async def test_a_reload_keeps_the_state_of_scorers_that_stay():
    config = RoutingConfig(scorers={"round_robin": 1})
    r = router()
    f = fleet(replica("a"), replica("b"))
    assert (await r.rank(route(), f, config)).replicas[0].id == "a"
    both = RoutingConfig(scorers={"round_robin": 1, "least_loaded": 0.01})
    assert (await r.rank(route(), f, both)).replicas[0].id == "b"


async def test_each_ranking_uses_the_scorers_of_the_config_it_is_given():
    # a request that started before a reload ranks under its own config, one after under the new
    r = router()
    f = fleet(replica("busy"), replica("idle"), reserved={"busy": 900})
    before = RoutingConfig(scorers={"least_loaded": 1})
    after = RoutingConfig(scorers={"round_robin": 1})
    assert (await r.rank(route(), f, after)).replicas[0].id == "busy"  # round robin's first turn
    assert [(await r.rank(route(), f, before)).replicas[0].id for _ in range(2)] == ["idle"] * 2


def test_an_unknown_plugin_or_a_parameter_it_refuses_is_a_config_error_naming_its_path():
    with pytest.raises(ConfigError, match=r"routing\.plugins\.nearest: unknown plugin"):
        check_routing(RoutingConfig(plugins={"nearest": {}}))
    with pytest.raises(ConfigError) as refused:
        check_routing(RoutingConfig(plugins={"session": {"load_floor": 2, "color": 1}}))
    assert [p.split(":")[0] for p in refused.value.problems] == [
        "routing.plugins.session.load_floor", "routing.plugins.session.color",
    ]
    # the hold has its home in routing.sessions, where it is checked against latency targets
    with pytest.raises(ConfigError, match=r"routing\.plugins\.session\.affinity_wait_s"):
        check_routing(RoutingConfig(plugins={"session": {"affinity_wait_s": 0.1}}))


def test_the_config_forms_before_plugins_had_parameters_mean_what_they_meant():
    # routing.scorers weighs, routing.sessions and load_factor parameterise the session plugin
    old = RoutingConfig.model_validate(
        {"scorers": {"session": 1}, "sessions": {"affinity_wait_s": 0.5}, "load_factor": 1}
    )
    check_routing(old)
    step = next(s for s in router().plan(old).pickers if s.name == "session")
    assert (step.weight, step.params.affinity_wait_s, step.params.load_factor) == (1, 0.5, 1)
    # routing.plugins.<name> overrides them
    new = old.model_copy(update={"plugins": {"session": {"load_factor": 0.5}}})
    check_routing(new)
    step = next(s for s in router().plan(new).pickers if s.name == "session")
    assert (step.params.load_factor, step.params.affinity_wait_s) == (0.5, 0.5)


async def test_a_session_plugin_weighted_0_binds_sessions_but_never_holds():
    store = MemoryStore()
    await store.bind(Sessions.store_key("chat-1"), "a", 60)
    config = RoutingConfig(scorers={"session": 0, "least_loaded": 1})
    r = router(store)
    f = fleet(replica("a"), replica("b"), reserved={"a": 100})
    ranking = await r.rank(route(session="chat-1"), f, config)
    assert ranking.hold is None and [v.id for v in ranking.replicas] == ["b", "a"]
    await r.served(route(session="chat-2"), ranking, "b", config, 200)
    assert await store.lookup(Sessions.store_key("chat-2")) == "b"
