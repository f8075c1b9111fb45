"""least_loaded: ledger headroom first, then the shorter vLLM queue; scores in [0, 1]."""

from __future__ import annotations

from kvgate.routing.plugin import NoParams
from kvgate.routing.plugins.least_loaded import LeastLoaded
from kvgate.routing.ranking import Cycle
from tests.routing.fleets import deps, fleet, replica, route


async def test_least_loaded_prefers_ledger_headroom_then_a_short_vllm_queue():
    f = fleet(replica("a"), replica("b"), replica("c", waiting=6),
              reserved={"a": 600, "b": 100, "c": 100})
    scores = await LeastLoaded(deps()).score(route(), list(f), f, NoParams(), Cycle())
    assert all(0 <= s <= 1 for s in scores)
    a, b, c = scores
    assert b > c > a  # b and c have equal headroom; c's vLLM queue is longer


async def test_least_loaded_scores_unknown_capacity_as_full():
    unknown = replica("u")
    unknown.config = unknown.config.model_copy(update={"num_gpu_blocks": None})
    f = fleet(unknown, replica("k"), reserved={"k": 999})
    u, k = await LeastLoaded(deps()).score(route(), list(f), f, NoParams(), Cycle())
    assert u <= k
