"""bench/ttft_floor.py: a request's TTFT alone on its replica, the floor under any gateway."""

from __future__ import annotations

import random

import ttft_floor  # bench/ttft_floor.py
from fleetbench import fleet
from fleetbench.capacity import sim_config
from fleetbench.prompts import chat, words

from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.engine import Engine
from kvgate.sim.text import PromptEncoder


def test_a_longer_prompt_has_a_higher_floor_and_the_engine_is_idle_after_each():
    rng = random.Random(0)
    normal = next(r for r in fleet.replicas({n: 0 for n in fleet.REPLICAS}, 1.0, {})
                  if r.pool == "default")  # fmt: skip
    engine = Engine(sim_config(normal))
    encoder = PromptEncoder(load_tiktoken())
    short = chat(0.0, "short", "vip", None, [words(rng, 50)], [], 64)
    long = chat(0.0, "short", "vip", None, [words(rng, 4000)], [], 64)
    floors = [ttft_floor.alone_ttft(engine, item, n, encoder)
              for n, item in enumerate((short, long))]  # fmt: skip
    assert 0 < floors[0] < floors[1]
    assert not engine.has_unfinished_requests()
    # 4,000 prompt tokens at 2,048 per step: at least two prefill steps before the first token
    assert floors[1] >= 2 * floors[0]
