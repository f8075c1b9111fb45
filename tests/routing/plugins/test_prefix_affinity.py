"""prefix_affinity: one prefix to one replica within bounded load, and the count of where
requests with a prefix ran."""

from __future__ import annotations

from dataclasses import replace

from kvgate.config import RoutingConfig
from kvgate.fleet.kv_wire import Event
from kvgate.metrics import Metrics
from kvgate.routing.bounded import BoundedLoad
from kvgate.routing.plugins.prefix_affinity import PrefixAffinity, hash_order, preferred
from kvgate.routing.ranking import Cycle
from kvgate.routing.route import Route
from kvgate.routing.router import Router
from tests.plugins.metrics import sample_value
from tests.routing.fleets import DOCUMENT, deps, fleet, indexed, replica, route

PARAMS = PrefixAffinity.settings(RoutingConfig(), {})


async def test_prefix_affinity_sends_one_prefix_to_one_replica_while_it_is_within_bounds():
    f = fleet(replica("a"), replica("b"), replica("c"), replica("d"))
    plugin = PrefixAffinity(deps())
    scores = await plugin.score(route(prefix="sys-1"), list(f), f, PARAMS, Cycle())
    assert sorted(scores) == [0.0, 0.0, 0.0, 1.0]
    again = await PrefixAffinity(deps()).score(route(prefix="sys-1"), list(f), f, PARAMS, Cycle())
    assert again == scores  # the same on every call, and on every instance
    none = await plugin.score(route(prefix=None), list(f), f, PARAMS, Cycle())
    assert none == [0.0] * 4


def test_its_parameters_default_to_the_routing_sections_bounded_load():
    config = RoutingConfig(load_factor=2, load_floor=0.5)
    assert PrefixAffinity.settings(config, {}) == BoundedLoad(load_factor=2, load_floor=0.5)


def test_prefixes_spread_over_the_replicas():
    f = fleet(*(replica(n) for n in "abcd"))
    firsts = {hash_order(f"prefix-{i}", list(f))[0].id for i in range(64)}
    assert firsts == set("abcd")


def test_a_replica_over_its_bounded_share_passes_the_prefix_to_the_next_in_its_order():
    views = list(fleet(*(replica(n) for n in "abcd")))
    order = [v.id for v in hash_order("sys", views)]
    first, second = order[0], order[1]
    # the preferred replica holds 400 of the 700 blocks reserved in the pool: 1.25 × its fair
    # share of 700 + 10 is 222, so the prefix goes to the next in its order
    loaded = fleet(*(replica(n) for n in "abcd"),
                   reserved={first: 400, second: 100, order[2]: 100, order[3]: 100})
    assert preferred("sys", list(loaded), 10, 0.25).id == second
    # within its share it keeps the prefix
    even = fleet(*(replica(n) for n in "abcd"), reserved=dict.fromkeys("abcd", 100))
    assert preferred("sys", list(even), 10, 0.25).id == first
    # a replica holding nothing may always take one request
    idle = fleet(*(replica(n) for n in "abcd"))
    assert preferred("sys", list(idle), 10, 0.25).id == first


async def test_a_served_request_with_a_prefix_is_counted_preferred_or_elsewhere():
    metrics = Metrics()
    router = Router(deps(metrics=metrics))
    config = RoutingConfig(scorers={"prefix_affinity": 1})
    f = fleet(replica("a"), replica("b"))
    ranking = await router.rank(route(prefix="sys"), f, config)
    favourite = ranking.replicas[0].id
    other = ranking.replicas[1].id
    await router.served(route(prefix="sys"), ranking, favourite, config, 200)
    await router.served(route(prefix="sys"), ranking, other, config, 200)
    await router.served(route(prefix="sys"), ranking, other, config, 0)
    await router.served(route(prefix=None), ranking, other, config, 200)
    routes = metrics.prefix_routes
    assert sample_value(routes, "p", "preferred") == 1
    assert sample_value(routes, "p", "elsewhere") == 2


# --------------------------------------------------------------------------- precise (KV events)


def precise_route(tokens: list[int], prefix: str | None = "sys") -> Route:
    base = route(prefix=prefix)
    return Route(base.demand, prefix=base.prefix, token_ids=tuple(tokens))


async def test_with_kv_events_the_replica_holding_most_of_the_prompt_scores_highest():
    f = fleet(replica("a"), replica("b"), replica("c"))
    events = indexed({"a": DOCUMENT[:16 * 2], "b": DOCUMENT, "c": []})
    plugin = PrefixAffinity(replace(deps(), kv_events=events))
    question = DOCUMENT + [7] * 40  # the document, then this user's question
    assert await plugin.score(precise_route(question), list(f), f, PARAMS, Cycle()) == [0.25, 1.0, 0.0]


async def test_a_replica_beyond_its_bounded_share_scores_nothing_whatever_it_holds():
    f = fleet(replica("a"), replica("b"), replica("c"), reserved={"b": 900, "a": 10, "c": 10})
    events = indexed({"a": DOCUMENT[:16 * 2], "b": DOCUMENT, "c": []})
    plugin = PrefixAffinity(replace(deps(), kv_events=events))
    assert await plugin.score(precise_route(DOCUMENT), list(f), f, PARAMS, Cycle()) == [1.0, 0.0, 0.0]


async def test_without_token_ids_events_or_any_block_held_the_fingerprint_decides():
    f = fleet(replica("a"), replica("b"), replica("c"))
    fingerprint = await PrefixAffinity(deps()).score(route(prefix="sys"), list(f), f, PARAMS, Cycle())
    events = indexed({"a": [], "b": [], "c": []})  # subscribed, but nobody holds this prompt
    plugin = PrefixAffinity(replace(deps(), kv_events=events))
    assert await plugin.score(precise_route(DOCUMENT), list(f), f, PARAMS, Cycle()) == fingerprint
    held = PrefixAffinity(replace(deps(), kv_events=indexed({"b": DOCUMENT})))
    assert await held.score(route(prefix="sys"), list(f), f, PARAMS, Cycle()) == fingerprint  # no ids
    assert await PrefixAffinity(deps()).score(precise_route(DOCUMENT), list(f), f, PARAMS, Cycle()) == (
        fingerprint)  # no events at all


async def test_an_evicted_prefix_stops_attracting_its_requests_with_the_event_that_evicts_it():
    f = fleet(replica("a"), replica("b"))
    events = indexed({"a": [], "b": DOCUMENT})
    plugin = PrefixAffinity(replace(deps(), kv_events=events))
    assert await plugin.score(precise_route(DOCUMENT), list(f), f, PARAMS, Cycle()) == [0.0, 1.0]
    events.states["b"].index.apply(Event("removed", tuple(range(8))))  # one batch: all evicted
    events.states["a"].index.apply(Event("stored", (50, 51), None, tuple(DOCUMENT[:32]), 16))
    assert await plugin.score(precise_route(DOCUMENT), list(f), f, PARAMS, Cycle()) == [1.0, 0.0]
