"""kvgate counts a chat's prompt as vLLM does: with the model directory's own tokenizer and chat
template, on varied chats (roles, tools and tool calls, typed content parts, long, Unicode),
the count equals the `prompt_tokens` the engine reports, to the token."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest

from kvgate.request.catalog import Catalog
from kvgate.tools.tiny_model import MODEL_NAME
from tests.plugins.gateway import wait_settled
from tests.real.conftest import real_config, wait_idle

pytestmark = pytest.mark.timeout(180)

PIECES = ["The cache holds the prompt.", "Ünïcödé naïve café —", "日本語のテキスト", "😀 emoji 🚀",
          "  leading and trailing spaces  ", "tabs\tand\nnew\nlines", "<|im_start|> in text",
          "</s> looks special", "{\"json\": [1, 2, 3]}", "def f(x):\n    return x * 2",
          "a" * 40, "1234567890 3.14159 2026-12-07", "Ok.", ""]  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web: ü, 日本",
     "parameters": {"type": "object", "properties": {"q": {"type": "string"},
                                                     "n": {"type": "integer"}}}}},
]  # fmt: skip


def text(rng: random.Random, long: bool = False) -> str:
    count = rng.randint(60, 120) if long else rng.randint(1, 6)
    return " ".join(rng.choice(PIECES) for _ in range(count))


def varied_chat(seed: int) -> dict[str, Any]:
    """One chat of the seeded variety: a system prompt or not, several turns, tool calls and
    their results, content as typed parts, a long document, Unicode everywhere."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        messages.append({"role": "system", "content": text(rng)})
    for turn in range(rng.randint(1, 4)):
        if rng.random() < 0.3:
            parts = [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 3))]
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": "user", "content": text(rng, long=rng.random() < 0.15)})
        if rng.random() < 0.25:
            call = {"id": f"call_{seed}_{turn}", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": rng.choice(PIECES)})}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": text(rng)})
        if turn or rng.random() < 0.5:
            messages.append({"role": "assistant", "content": text(rng)})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": text(rng)})
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}
    if rng.random() < 0.3:
        body.update(tools=TOOLS, tool_choice="none")
    return body


async def prompt_tokens(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        answer = await response.json()
        assert response.status == 200, answer
        return int(answer["usage"]["prompt_tokens"])


@pytest.mark.parametrize(("engine", "content_format"), [("a", "openai"), ("string", "string")])
async def test_kvgates_count_equals_vllms_prompt_tokens_on_120_varied_chats(
    engines, engine, content_format
):
    """With the model's own template, which loops over typed content parts, and with a
    "string" template, to which vLLM hands each message's text parts joined by newlines."""
    counter = Catalog(real_config(engines, [engine])).counter(MODEL_NAME)
    assert counter.template is not None
    assert counter.template.content_format == content_format
    bodies = [varied_chat(seed) for seed in range(120)]
    async with aiohttp.ClientSession() as http:
        reported: list[int] = []
        for start in range(0, len(bodies), 12):
            batch = bodies[start:start + 12]
            reported += await asyncio.gather(
                *(prompt_tokens(http, engines[engine].url, b) for b in batch))
    misses = []
    for seed, (body, vllm_count) in enumerate(zip(bodies, reported, strict=True)):
        count = await counter.count_chat(body["messages"], body.get("tools"))
        assert count.templated, seed
        if count.features.text_tokens != vllm_count:
            misses.append((seed, count.features.text_tokens, vllm_count))
    assert misses == [], f"(seed, kvgate, vLLM): {misses}"
    assert max(reported) > 1000 and min(reported) < 80  # long and short ones both
    await wait_idle(engines[engine])


async def test_through_kvgate_the_estimate_is_exact(engines, gateway_factory):
    gw = await gateway_factory(real_config(engines, ["a"]))
    async with aiohttp.ClientSession() as http:
        for seed in range(200, 216):
            await prompt_tokens(http, gw.url, varied_chat(seed))
    await wait_settled(gw)
    assert gw.gateway.calibration.error(MODEL_NAME, "chat+template") == 0.0
    await wait_idle(engines["a"])
