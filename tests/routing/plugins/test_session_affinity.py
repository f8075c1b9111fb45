"""session: the session's replica scores 1, is held for affinity_wait_s where its binding is,
and becomes the session's binding once it served a request."""

from __future__ import annotations

from kvgate.config import RoutingConfig
from kvgate.metrics import Metrics
from kvgate.routing.plugins.prefix_affinity import hash_order
from kvgate.routing.plugins.session_affinity import SessionAffinity
from kvgate.routing.ranking import Cycle
from kvgate.routing.router import Router
from kvgate.routing.sessions import Sessions
from kvgate.state.memory import MemoryStore
from tests.plugins.metrics import sample_value
from tests.routing.fleets import deps, fleet, replica, route

CONFIG = RoutingConfig()
PARAMS = SessionAffinity.settings(CONFIG, {})


async def test_session_scores_the_bound_replica_only():
    store = MemoryStore()
    f = fleet(replica("a"), replica("b"))
    scorer = SessionAffinity(deps(store))
    # unbound: the first replica in the session key's own hash order
    first = hash_order("s1", list(f))[0].id
    assert await scorer.score(route(session="s1"), list(f), f, PARAMS, Cycle()) == [
        1.0 if v.id == first else 0.0 for v in f
    ]
    await store.bind(Sessions.store_key("s2"), "b", 60)
    assert await scorer.score(route(session="s2"), list(f), f, PARAMS, Cycle()) == [0.0, 1.0]
    # a bound replica over its bounded share is not preferred: the session will be rebound
    hot = fleet(replica("a"), replica("b"), reserved={"a": 10, "b": 900})
    assert await scorer.score(route(session="s2"), list(hot), hot, PARAMS, Cycle()) == [1.0, 0.0]
    assert await scorer.score(route(session=None), list(f), f, PARAMS, Cycle()) == [0.0, 0.0]


def test_its_parameters_default_to_routing_sessions_and_bounded_load():
    config = RoutingConfig.model_validate(
        {"sessions": {"affinity_wait_s": 0.5, "ttl_s": 60}, "load_floor": 0.2}
    )
    params = SessionAffinity.settings(config, {})
    assert (params.affinity_wait_s, params.ttl_s, params.load_floor) == (0.5, 60, 0.2)


async def test_an_unbound_session_is_not_held_for_the_replica_it_scored():
    # the hold is worth it only where the session's cache already is
    ranking = await Router(deps()).rank(route(session="new"), fleet(replica("a"), replica("b")),
                                        CONFIG)
    assert ranking.cycle.favourites["session"] in ("a", "b") and ranking.hold is None


async def test_the_held_replica_alone_is_usable_during_the_hold_unless_it_is_busy():
    store = MemoryStore()
    await store.bind(Sessions.store_key("chat"), "b", 60)
    f = fleet(replica("a"), replica("b"))
    ranking = await Router(deps(store)).rank(route(session="chat"), f, CONFIG)
    wait = CONFIG.sessions.affinity_wait_s
    assert [v.id for v in ranking.usable(0)] == ["b"]
    assert [v.id for v in ranking.usable(wait)] == [v.id for v in ranking.replicas]


async def test_a_replica_that_served_the_request_becomes_the_sessions_binding():
    store, metrics = MemoryStore(), Metrics()
    router = Router(deps(store, metrics))
    f = fleet(replica("a"), replica("b"))
    ranking = await router.rank(route(session="chat"), f, CONFIG)
    await router.served(route(session="chat"), ranking, "a", CONFIG, 500)  # failed: not bound
    assert await store.lookup(Sessions.store_key("chat")) is None
    await router.served(route(session="chat"), ranking, "a", CONFIG, 404)
    assert await store.lookup(Sessions.store_key("chat")) == "a"
    assert sample_value(metrics.session_routes, "new", "unbound") == 1


async def test_a_new_session_whose_prompt_the_kv_events_can_place_leaves_it_to_them():
    """Where its prompt is cached beats the session key's hash; a bound session keeps its
    replica (its cache is there)."""
    from dataclasses import replace

    from kvgate.routing.route import Route
    from tests.routing.fleets import DOCUMENT, indexed

    store = MemoryStore()
    f = fleet(replica("a"), replica("b"))
    scorer = SessionAffinity(replace(deps(store), kv_events=indexed({"a": DOCUMENT, "b": []})))
    base = route(session="s1")
    placed = Route(base.demand, session_key="s1", token_ids=tuple(DOCUMENT))
    assert await scorer.score(placed, list(f), f, PARAMS, Cycle()) == [0.0, 0.0]
    assert sum(await scorer.score(base, list(f), f, PARAMS, Cycle())) == 1.0  # no token ids: its hash
    await store.bind(Sessions.store_key("s2"), "b", 60)
    bound = Route(base.demand, session_key="s2", token_ids=tuple(DOCUMENT))
    assert await scorer.score(bound, list(f), f, PARAMS, Cycle()) == [0.0, 1.0]
