"""Each scorer on hand-made fleet snapshots: scores in [0, 1], and the preference it states."""

from __future__ import annotations

import pytest

from kvgate.config import RoutingConfig
from kvgate.metrics import Metrics
from kvgate.routing.bounded import within_bound
from kvgate.routing.scorers.least_loaded import LeastLoaded
from kvgate.routing.scorers.prefix_affinity import PrefixAffinity, hash_order, preferred
from kvgate.routing.scorers.round_robin import RoundRobin
from kvgate.routing.scorers.session import SessionAffinity
from kvgate.routing.sessions import Sessions
from kvgate.state.memory import MemoryStore
from tests.routing.fleets import fleet, replica, route

CONFIG = RoutingConfig()


async def test_least_loaded_prefers_ledger_headroom_then_a_short_vllm_queue():
    f = fleet(replica("a"), replica("b"), replica("c", waiting=6),
              reserved={"a": 600, "b": 100, "c": 100})
    scores = await LeastLoaded().score(route(), list(f), f, CONFIG)
    assert all(0 <= s <= 1 for s in scores)
    a, b, c = scores
    assert b > c > a  # b and c have equal headroom; c's vLLM queue is longer


async def test_least_loaded_scores_unknown_capacity_as_full():
    unknown = replica("u")
    unknown.config = unknown.config.model_copy(update={"num_gpu_blocks": None})
    f = fleet(unknown, replica("k"), reserved={"k": 999})
    u, k = await LeastLoaded().score(route(), list(f), f, CONFIG)
    assert u <= k


async def test_round_robin_moves_the_first_choice_one_step_per_request():
    f = fleet(replica("a"), replica("b"), replica("c"))
    rr = RoundRobin()
    firsts = []
    for _ in range(6):
        scores = await rr.score(route(), list(f), f, CONFIG)
        assert all(0 <= s <= 1 for s in scores)
        firsts.append(list(f)[scores.index(max(scores))].id)
    assert firsts == ["a", "b", "c", "a", "b", "c"]


async def test_prefix_affinity_sends_one_prefix_to_one_replica_while_it_is_within_bounds():
    f = fleet(replica("a"), replica("b"), replica("c"), replica("d"))
    scores = await PrefixAffinity().score(route(prefix="sys-1"), list(f), f, CONFIG)
    assert sorted(scores) == [0.0, 0.0, 0.0, 1.0]
    again = await PrefixAffinity().score(route(prefix="sys-1"), list(f), f, CONFIG)
    assert again == scores  # the same on every call, and on every instance
    none = await PrefixAffinity().score(route(prefix=None), list(f), f, CONFIG)
    assert none == [0.0] * 4


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


def test_bounded_load_counts_capacity_not_replicas():
    big, small = replica("big", blocks=3000), replica("small", blocks=1000)
    reserved = {"big": 1500, "small": 500}  # each at half its capacity: both within bounds
    views = list(fleet(big, small, reserved=reserved))
    assert all(within_bound(v, views, 10, 0.25) for v in views)
    # the small one at 3/4 of the pool's blocks is over 1.25 × its quarter
    skewed = list(fleet(big, small, reserved={"big": 500, "small": 1500}))
    assert [v.id for v in skewed if within_bound(v, skewed, 10, 0.25)] == ["big"]


async def test_session_scores_the_bound_replica_only():
    store = MemoryStore()
    sessions = Sessions(store, Metrics())
    f = fleet(replica("a"), replica("b"))
    scorer = SessionAffinity(sessions)
    # unbound: the first replica in the session key's own hash order
    first = hash_order("s1", list(f))[0].id
    assert await scorer.score(route(session="s1"), list(f), f, CONFIG) == [
        1.0 if v.id == first else 0.0 for v in f
    ]
    await store.bind(Sessions.store_key("s2"), "b", 60)
    assert await scorer.score(route(session="s2"), list(f), f, CONFIG) == [0.0, 1.0]
    # a bound replica over its bounded share is not preferred: the session will be rebound
    hot = fleet(replica("a"), replica("b"), reserved={"a": 10, "b": 900})
    assert await scorer.score(route(session="s2"), list(hot), hot, CONFIG) == [1.0, 0.0]
    assert await scorer.score(route(session=None), list(f), f, CONFIG) == [0.0, 0.0]


@pytest.mark.parametrize("name", ["least_loaded", "round_robin", "prefix_affinity", "session"])
async def test_every_registered_scorer_scores_within_0_and_1(name):
    from kvgate.routing.scorers import SCORERS, Deps

    scorer = SCORERS[name](Deps(Sessions(MemoryStore(), Metrics())))
    f = fleet(replica("a"), replica("b", waiting=100), replica("c"),
              reserved={"a": 1000, "b": 0, "c": 5000})
    scores = await scorer.score(route(session="s", prefix="x"), list(f), f, CONFIG)
    assert len(scores) == 3 and all(0 <= s <= 1 for s in scores)
