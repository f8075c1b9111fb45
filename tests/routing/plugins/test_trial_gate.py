"""trial_gate: a half-open replica is ranked only for the request holding its trial."""

from __future__ import annotations

from kvgate.config import RoutingConfig
from kvgate.fleet.health import Breakers
from kvgate.routing.router import Router
from kvgate.routing.sessions import Sessions
from kvgate.state.memory import MemoryStore
from tests.routing.fleets import CONFIG, deps, fleet, replica, route


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def half_open(replica_id: str) -> tuple[Breakers, Clock]:
    clock = Clock()
    breakers = Breakers(lambda: CONFIG, clock)
    for i in range(CONFIG.routing.circuit.failure_threshold):
        breakers.judge(replica_id, True, f"old-{i}")
    clock.now = CONFIG.routing.circuit.open_s
    return breakers, clock


async def test_the_ranking_keeps_a_half_open_replica_only_for_the_trial_holder():
    breakers, _ = half_open("a")
    store = MemoryStore()
    await store.bind(Sessions.store_key("chat"), "a", 60)
    router = Router(deps(store, breakers=breakers))
    snapshot = fleet(replica("a"), replica("b"), circuits={"a": breakers.state("a")})
    config = RoutingConfig()
    first = await router.rank(route(session="chat", holder="first"), snapshot, config)
    assert [v.id for v in first.replicas] == ["a", "b"] and first.hold is not None
    second = await router.rank(route(session="chat", holder="second"), snapshot, config)
    assert [v.id for v in second.replicas] == ["b"] and second.hold is None
    breakers.release("first")  # the first request is over: the trial goes to the next
    third = await router.rank(route(holder="third"), snapshot, config)
    assert "a" in [v.id for v in third.replicas]


async def test_a_route_without_a_holder_never_gets_a_half_open_replica():
    breakers, _ = half_open("a")
    snapshot = fleet(replica("a"), replica("b"), circuits={"a": breakers.state("a")})
    ranking = await Router(deps(breakers=breakers)).rank(route(), snapshot, RoutingConfig())
    assert [v.id for v in ranking.replicas] == ["b"]
