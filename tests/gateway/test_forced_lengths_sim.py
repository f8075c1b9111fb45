"""Requests that say how long their answer will be, in front of a simulated replica.

"26% but full": ordinary short answers hold part of a replica when requests arrive whose
`ignore_eos` makes them write all of a long `max_tokens`. Predicted admission must reserve
what they will write — not what the short answers before them suggest — so only as many run
as fit to the end, the rest queue, and vLLM never has to preempt.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.plugins.gateway import gateway_config, wait_settled

BLOCK = 16
# 250 blocks, 225 admissible; a forced answer holds (512 + 2,048) / 16 = 160 blocks at its end:
# one fits beside the short answers, two never do.
SIM = dict(num_gpu_blocks=250, block_size=BLOCK, max_model_len=3072, max_num_seqs=64,
           time_scale=0.004, output_len_dist="lognormal", output_len_median_fraction=0.15,
           output_len_sigma=0.3)
ADMISSION = {"queue": {"max_wait_s": 120, "wait_budget_s": {"standard": 120}}}
LONG_PROMPT = " ".join(["data"] * 500)  # about 512 tokens with the template


def short(i: int) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": 128,
            "messages": [{"role": "user", "content": f"Short question {i}?"}]}


def forced(i: int, **fields: Any) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": 2048, **fields,
            "messages": [{"role": "user", "content": f"{i} {LONG_PROMPT}"}]}


async def send_all(url: str, bodies: list[dict[str, Any]], sim: Any) -> int:
    """Send the bodies at once; the most forced-length requests the replica had together."""
    engine = sim.engine
    peak = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()  # type: ignore[no-any-return]

        tasks = [asyncio.create_task(one(b)) for b in bodies]
        while not all(t.done() for t in tasks):
            queued = [*engine.running, *engine.waiting]
            peak = max(peak, sum(1 for r in queued if r.max_tokens == 2048))
            await asyncio.sleep(0.002)
        answers = [t.result() for t in tasks]
    for body, answer in zip(bodies, answers, strict=True):
        if body.get("ignore_eos"):
            assert answer["usage"]["completion_tokens"] == body["max_tokens"]
    return peak


async def test_ignore_eos_answers_reserve_what_they_will_write_and_never_preempt(
    sim_factory, gateway_factory
):
    sim = await sim_factory(**SIM)
    gw = await gateway_factory(gateway_config([sim.url], admission=ADMISSION))
    await send_all(gw.url, [short(i) for i in range(20)], sim)  # the predictor learns "short"
    bodies = [short(100 + i) for i in range(12)] + [forced(i, ignore_eos=True) for i in range(4)]
    peak = await send_all(gw.url, bodies, sim)
    await wait_settled(gw)
    assert peak == 1
    assert sim.engine.stats.num_preemptions == 0


async def test_min_tokens_is_reserved_as_written(sim_factory, gateway_factory):
    sim = await sim_factory(**SIM)
    gw = await gateway_factory(gateway_config([sim.url], admission=ADMISSION))
    await send_all(gw.url, [short(i) for i in range(20)], sim)
    (replica,) = gw.gateway.registry
    url = f"{gw.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(
        url, json=forced(0, min_tokens=1500)
    ) as r:
        assert r.status == 200
        assert r.headers["X-Kvgate-Replica"] == replica.id
        reserved = int(r.headers["X-Kvgate-Reserved-Blocks"])
        prompt = int(r.headers["X-Kvgate-Prompt-Tokens"])
        await r.read()
    assert reserved >= -(-(prompt + 1500) // BLOCK)
    await wait_settled(gw)
