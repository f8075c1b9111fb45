"""round_robin: the first choice moves one replica per request."""

from __future__ import annotations

from kvgate.routing.plugin import NoParams
from kvgate.routing.plugins.round_robin import RoundRobin
from kvgate.routing.ranking import Cycle
from tests.routing.fleets import deps, fleet, replica, route


async def test_round_robin_moves_the_first_choice_one_step_per_request():
    f = fleet(replica("a"), replica("b"), replica("c"))
    rr = RoundRobin(deps())
    firsts = []
    for _ in range(6):
        scores = await rr.score(route(), list(f), f, NoParams(), Cycle())
        assert all(0 <= s <= 1 for s in scores)
        firsts.append(list(f)[scores.index(max(scores))].id)
    assert firsts == ["a", "b", "c", "a", "b", "c"]
