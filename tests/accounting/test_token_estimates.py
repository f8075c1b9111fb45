"""kvgate's prompt-token estimate against what the replica counts, request by request.

Every forwarded response carries `X-Kvgate-Prompt-Tokens`; the simulator renders ChatML with
special-token markers (as a Qwen replica does) and reports `usage.prompt_tokens`. On a varied
prompt set the estimate must be within 2% on average and never short by more than a block —
from the first request (the configured prior) and after calibration has seen a few hundred.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import openai
import pytest

from tests.accounting import prompts
from tests.plugins.gateway import gateway_config

BLOCK = 16


async def send(client: openai.AsyncOpenAI, body: dict[str, Any]) -> tuple[int, int]:
    """(kvgate's estimate, the replica's prompt_tokens) for one request."""
    body = dict(body)
    if "messages" in body:
        raw = await client.chat.completions.with_raw_response.create(**body)
    else:
        raw = await client.completions.with_raw_response.create(**body)
    usage = raw.parse().usage
    assert usage is not None
    return int(raw.headers["x-kvgate-prompt-tokens"]), usage.prompt_tokens


async def exported(url: str, name: str, within_s: float = 5.0) -> float | None:
    """The gauge's value on /metrics once it appears (None if it does not within `within_s`)."""
    async with aiohttp.ClientSession() as http:
        for _ in range(int(within_s / 0.2)):
            async with http.get(f"{url}/metrics") as response:
                for line in (await response.text()).splitlines():
                    if line.startswith(name + "{"):
                        return float(line.rsplit(" ", 1)[1])
            await asyncio.sleep(0.2)
    return None


def errors(pairs: list[tuple[int, int]]) -> tuple[float, int]:
    """Mean absolute relative error, and the largest under-count in tokens."""
    mean = sum(abs(e - a) / a for e, a in pairs) / len(pairs)
    return mean, max(a - e for e, a in pairs)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_estimates_match_the_replicas_count_within_two_percent(
    sim_factory, gateway_factory, endpoint
):
    sim = await sim_factory(num_gpu_blocks=4096, max_model_len=8192, time_scale=0.001)
    gw = await gateway_factory(gateway_config([sim.url]))
    rng = random.Random(11)
    make = prompts.chat if endpoint == "chat" else prompts.completion
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    async with client:
        pairs = [await send(client, make(rng, i)) for i in range(400)]
    cold, warm = pairs[:50], pairs[-200:]
    cold_error, cold_short = errors(cold)
    warm_error, warm_short = errors(warm)
    assert cold_short <= BLOCK, f"cold start under-counts by {cold_short} tokens"
    assert warm_short <= BLOCK, f"under-counts by {warm_short} tokens after calibration"
    assert warm_error < 0.02, f"mean error {warm_error:.2%} after calibration"
    # the fit's gauges follow off the request path, once a second
    gauge = await exported(gw.url, "kvgate_tokenizer_estimate_error_ratio")
    assert gauge is not None and abs(gauge) < 0.02, gauge
    print(f"{endpoint}: cold {cold_error:.2%} (short ≤ {cold_short}), "
          f"calibrated {warm_error:.2%} (short ≤ {warm_short})")
