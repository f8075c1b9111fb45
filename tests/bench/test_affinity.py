"""bench/affinity.py at a small scale: multi-turn chats hit the simulators' prefix caches far
more through kvgate's router than through round robin (the replicas' own counters)."""

from __future__ import annotations

import affinity  # bench/affinity.py


async def test_multi_turn_chats_hit_the_cache_far_more_than_round_robin():
    shape = dict(replicas=4, chats=16, turns=3, doc_words=60, seed=1)
    routed = await affinity.run_once("kvgate", **shape)
    spread = await affinity.run_once("round_robin", **shape)
    assert routed.failures == spread.failures == 0
    assert routed.requests == spread.requests == 48
    assert routed.queries > 0 and spread.queries > 0
    assert routed.hit_rate >= 2 * spread.hit_rate, (routed, spread)
