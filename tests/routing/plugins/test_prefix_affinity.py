"""prefix_affinity: one prefix to one replica within bounded load, and the count of where
requests with a prefix ran."""

from __future__ import annotations

from kvgate.config import RoutingConfig
from kvgate.metrics import Metrics
from kvgate.routing.bounded import BoundedLoad
from kvgate.routing.plugins.prefix_affinity import PrefixAffinity, hash_order, preferred
from kvgate.routing.router import Router
from tests.routing.fleets import deps, fleet, replica, route

PARAMS = PrefixAffinity.settings(RoutingConfig(), {})


async def test_prefix_affinity_sends_one_prefix_to_one_replica_while_it_is_within_bounds():
    f = fleet(replica("a"), replica("b"), replica("c"), replica("d"))
    plugin = PrefixAffinity(deps())
    scores = await plugin.score(route(prefix="sys-1"), list(f), f, PARAMS)
    assert sorted(scores) == [0.0, 0.0, 0.0, 1.0]
    again = await PrefixAffinity(deps()).score(route(prefix="sys-1"), list(f), f, PARAMS)
    assert again == scores  # the same on every call, and on every instance
    none = await plugin.score(route(prefix=None), list(f), f, PARAMS)
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
    count = metrics.prefix_routes.labels
    assert count("p", "preferred")._value.get() == 1
    assert count("p", "elsewhere")._value.get() == 2
