"""kvgate's written-blocks view of a replica against the blocks the replica (the simulator)
really holds, sampled while requests run: streamed, non-streamed (estimated from elapsed time
and the replica's observed token rate), and sharing one system prompt (vLLM stores the shared
prefix once).

The error is |kvgate's written blocks − the replica's held blocks| ÷ the replica's blocks, sampled
while every request is running on the replica. (Before vLLM has admitted a request, kvgate
already counts its prompt: that start-up transient is reported, not asserted.)"""

from __future__ import annotations

import asyncio
import random
import statistics

import aiohttp

from tests.plugins.bodies import SIM_MODEL, chat
from tests.plugins.gateway import gateway_config

SIM = dict(num_gpu_blocks=1024, max_model_len=4096, max_num_seqs=64, time_scale=0.5)
N_REQUESTS, MAX_TOKENS = 12, 400
SYSTEM = "You are a careful assistant. " + " ".join(f"rule{i} applies." for i in range(100))


def body(rng: random.Random, stream: bool, shared: bool) -> dict:
    words = " ".join(rng.choice(("kv", "cache", "block", "token", "gpu", "decode")) + str(
        rng.randrange(10**6)) for _ in range(120))
    return chat(words, model=SIM_MODEL, system_prompt=SYSTEM if shared else None,
                max_tokens=MAX_TOKENS, ignore_eos=True, stream=stream)


async def measure(
    sim_factory, gateway_factory, *, stream: bool, shared: bool
) -> tuple[list[float], list[float]]:
    """The errors while every request runs on the replica, and while any is still waiting
    there."""
    sim = await sim_factory(**SIM)
    gw = await gateway_factory(gateway_config([sim.url], discovery={"interval_s": 0.1}))
    (replica,) = gw.gateway.registry
    rng = random.Random(1)
    errors: list[float] = []
    starting: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def one(payload: dict) -> None:
            async with session.post(f"{gw.url}/v1/chat/completions", json=payload) as r:
                assert r.status == 200, await r.text()
                await r.read()

        await one(body(rng, stream, shared))  # the replica's token rate is known after one
        tasks = [asyncio.create_task(one(body(rng, stream, shared))) for _ in range(N_REQUESTS)]
        while not all(t.done() for t in tasks):
            pool = sim.engine.pool
            held = pool.num_gpu_blocks - 1 - pool.num_free_blocks
            if len(replica.inflight) == N_REQUESTS and sim.engine.running:
                error = abs(replica.written_blocks() - held) / pool.num_gpu_blocks
                (errors if len(sim.engine.running) == N_REQUESTS else starting).append(error)
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
    assert len(errors) >= 10
    return errors, starting


def summary(errors: list[float], starting: list[float]) -> str:
    return (f"mean {statistics.mean(errors):.2%}, max {max(errors):.2%} over {len(errors)} "
            f"samples; while requests still wait in vLLM: mean "
            f"{statistics.mean(starting or [0]):.2%} over {len(starting)}")


async def test_streamed_unique_prompts(sim_factory, gateway_factory):
    errors, starting = await measure(sim_factory, gateway_factory, stream=True, shared=False)
    print("streamed:", summary(errors, starting))
    assert statistics.mean(errors) < 0.02


async def test_non_streamed_unique_prompts(sim_factory, gateway_factory):
    errors, starting = await measure(sim_factory, gateway_factory, stream=False, shared=False)
    print("non-streamed:", summary(errors, starting))
    assert statistics.mean(errors) < 0.02


async def test_streamed_with_a_shared_system_prompt(sim_factory, gateway_factory):
    errors, starting = await measure(sim_factory, gateway_factory, stream=True, shared=True)
    print("shared system prompt:", summary(errors, starting))
    assert statistics.mean(errors) < 0.02


def test_a_shared_prefix_counts_its_full_blocks_once_and_the_rest_per_request():
    from kvgate.config import ReplicaConfig
    from kvgate.fleet.replicas import Replica, Writing

    replica = Replica(ReplicaConfig(url="http://r", block_size=16), pool="default")
    sys = [("sys", 0), ("sys", 1)]
    replica.inflight = {
        "a": Writing(lambda: 100, sys),  # 2 shared blocks + 5 of its own
        "b": Writing(lambda: 70, sys),  # the same 2 + 3 of its own
        "c": Writing(lambda: 33),  # none shared: 3
        "d": Writing(lambda: 20, [*sys, ("sys", 2)]),  # has written 1 of its shared blocks
    }
    assert replica.written_blocks() == 2 + 5 + 3 + 3 + 1


def test_the_decode_clock_integrates_the_per_sequence_rate_and_survives_a_restart():
    from kvgate.fleet.scrape import DecodeClock, Scrape

    clock = DecodeClock()
    clock.observe(Scrape(at=0.0, generation_tokens=0, running=4))
    assert clock.now(1.0) is None  # one scrape: no rate yet
    clock.observe(Scrape(at=1.0, generation_tokens=400, running=4))  # 100/s per sequence
    assert clock.now(1.5) == 100 + 50
    clock.observe(Scrape(at=2.0, generation_tokens=10, running=2))  # restarted: skip
    clock.observe(Scrape(at=3.0, generation_tokens=110, running=2))  # 50/s per sequence
    assert clock.now(3.0) == 100 + 50


def test_the_decode_clock_never_runs_back_when_the_rate_falls_or_the_replica_restarts():
    from kvgate.fleet.scrape import DecodeClock, Scrape

    clock = DecodeClock()
    clock.observe(Scrape(at=0.0, generation_tokens=0, running=1))
    clock.observe(Scrape(at=1.0, generation_tokens=100, running=1))  # 100/s
    assert clock.now(1.9) == 190  # extrapolated at 100/s
    clock.observe(Scrape(at=2.0, generation_tokens=110, running=1))  # it slowed to 10/s
    readings = [clock.now(2.0 + t / 10) for t in range(20)]
    assert readings[0] == 190  # held, not 110
    assert readings == sorted(readings)


def test_the_decode_clock_holds_while_nothing_runs_and_leaves_out_a_late_older_read():
    from kvgate.fleet.scrape import DecodeClock, Scrape

    clock = DecodeClock()
    clock.observe(Scrape(at=0.0, generation_tokens=0, running=1))
    clock.observe(Scrape(at=1.0, generation_tokens=100, running=0))  # it ran, then went quiet
    assert clock.reading(5.0) == 100  # no sequence runs: nothing to extrapolate
    clock.observe(Scrape(at=2.0, generation_tokens=130, running=1))
    clock.observe(Scrape(at=1.5, generation_tokens=115, running=1))  # a slower, older read
    assert clock.reading(2.0) == 130
    assert clock.reading(2.5) == 130 + 15  # at the last rate, 30/s


def test_the_written_view_of_a_whole_answer_stays_between_its_prompt_and_worst_case():
    from kvgate.admission.progress import written_tokens
    from kvgate.config import ReplicaConfig
    from kvgate.fleet.replicas import Replica
    from kvgate.fleet.scrape import Scrape
    from kvgate.request.catalog import Bound
    from kvgate.request.parsed import Endpoint, ParsedRequest
    from kvgate.transport.base import Outcome

    replica = Replica(ReplicaConfig(url="http://127.0.0.1:1"), "pool")
    clock = replica.decode_clock
    clock.observe(Scrape(at=0.0, generation_tokens=0, running=1))
    clock.observe(Scrape(at=1.0, generation_tokens=1000, running=1))
    parsed = ParsedRequest(Endpoint.CHAT, {}, "m", False, False, 50, 1, None)
    bound = Bound(prompt_tokens=300, max_tokens=50, worst_tokens=350, set_max_tokens=False)
    outcome = Outcome(replica=replica, sent_at=0.0, decode_start=clock.reading(0.0))
    written = written_tokens(parsed, bound, outcome)
    seen = [written()]
    clock.observe(Scrape(at=2.0, generation_tokens=5, running=1))  # restarted: counters reset
    seen.append(written())
    clock.tokens += 10_000  # a clock far ahead: the answer still has at most max_tokens
    seen.append(written())
    assert all(300 <= value <= 350 for value in seen), seen
    assert seen == sorted(seen)
