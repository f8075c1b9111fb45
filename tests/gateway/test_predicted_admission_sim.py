"""Predicted admission in front of a simulated replica with realistic answer lengths.

Clients ask for max_tokens 2,000 and the model answers ~200 (lognormal): reserving the worst
case admits two requests at a time on this replica, although a dozen fit. Predicted admission
reserves what answers really use, so many more run at once — and the replica still does not
run out of blocks (its own preemption counter), because reservations grow with their answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.plugins.bodies import SIM_MODEL, chat
from tests.plugins.gateway import gateway_config, wait_settled

SIM = dict(num_gpu_blocks=400, max_model_len=4096, max_num_seqs=64, time_scale=0.01,
           output_len_dist="lognormal", output_len_median_fraction=0.1, output_len_sigma=0.5)


def body(i: int) -> dict[str, Any]:
    return chat(f"Question {i} about paged attention.", model=SIM_MODEL, max_tokens=2000)


async def run(url: str, n: int, gw: Any) -> int:
    """Send n requests at once; the most kvgate had in flight on the replica at one time."""
    (replica,) = gw.gateway.registry
    peak = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one(i: int) -> int:
            async with session.post(f"{url}/v1/chat/completions", json=body(i)) as r:
                await r.read()
                return r.status

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        while not all(t.done() for t in tasks):
            peak = max(peak, len(replica.inflight))
            await asyncio.sleep(0.005)
        assert [t.result() for t in tasks] == [200] * n
    return peak


@pytest.mark.parametrize("mode", ["worst_case", "predicted"])
async def test_predicted_admission_runs_many_more_requests_without_preemption(
    sim_factory, gateway_factory, mode
):
    sim = await sim_factory(**SIM)
    gw = await gateway_factory(gateway_config(
        [sim.url], admission={"mode": mode, "queue": {"max_wait_s": 60}},
    ))
    await run(gw.url, 20, gw)  # the answers kvgate learns lengths from
    peak = await run(gw.url, 40, gw)
    await wait_settled(gw)
    if mode == "worst_case":
        assert peak <= 2  # (≈10 + 2000) / 16 = 126 blocks each, 360 admissible
    else:
        assert peak >= 8
    assert sim.engine.stats.num_preemptions == 0
    print(f"{mode}: peak {peak} in flight")
