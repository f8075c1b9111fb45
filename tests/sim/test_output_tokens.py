"""The benchmark-only `X-Sim-Output-Tokens` header: where a replayed request's answer stops."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import orjson

from kvgate.sim.options import OUTPUT_TOKENS_HEADER
from kvgate.sim.server import SimReplica

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about the data model."}]


async def test_the_answer_stops_after_the_headers_tokens_on_its_own(replica: SimReplica) -> None:
    async with openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x") as client:
        told = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=100,
            extra_headers={OUTPUT_TOKENS_HEADER: "37"},
        )  # fmt: skip
        untold = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=100
        )
    assert told.usage is not None and told.usage.completion_tokens == 37
    assert told.choices[0].finish_reason == "stop"  # its own end, not max_tokens
    # This replica's output_len_dist is "max": without the header it writes max_tokens.
    assert untold.usage is not None and untold.usage.completion_tokens == 100


async def test_a_stream_stops_at_the_headers_tokens(replica: SimReplica) -> None:
    async with openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x") as client:
        stream = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=100, stream=True,
            stream_options={"include_usage": True}, extra_headers={OUTPUT_TOKENS_HEADER: "9"},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) == 9
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


async def test_max_tokens_still_caps_and_ignore_eos_still_forces(replica: SimReplica) -> None:
    async with openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x") as client:
        capped = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=5,
            extra_headers={OUTPUT_TOKENS_HEADER: "40"},
        )  # fmt: skip
        forced = await client.completions.create(
            model="sim-model", prompt="Once", max_tokens=12, extra_body={"ignore_eos": True},
            extra_headers={OUTPUT_TOKENS_HEADER: "3"},
        )  # fmt: skip
    assert capped.usage is not None and capped.usage.completion_tokens == 5
    assert capped.choices[0].finish_reason == "length"
    assert forced.usage is not None and forced.usage.completion_tokens == 12


async def test_a_header_that_is_not_a_positive_integer_is_a_400(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    for bad in ("0", "-3", "many", "2.5"):
        async with http.post(
            replica.url + "/v1/chat/completions",
            json={"model": "sim-model", "messages": MESSAGES, "max_tokens": 10},
            headers={OUTPUT_TOKENS_HEADER: bad},
        ) as response:
            assert response.status == 400, bad
            error = orjson.loads(await response.read())["error"]
            assert OUTPUT_TOKENS_HEADER in error["message"]
    assert replica.engine.stats.steps == 0  # nothing reached the engine
