"""Lists of prompts, n and best_of: one engine request per (prompt, sequence), as vLLM V1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from kvgate.sim.faults import Faults
from kvgate.sim.server import SimReplica
from tests.plugins.sim import SimFactory
from tests.plugins.waiting import eventually
from tests.sim.helpers import post, post_stream, scrape, value

PROMPTS = ["Once upon a time", "The KV cache holds"]
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "Say something."}]}


@pytest.fixture
async def client(replica: SimReplica) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x") as c:
        yield c


async def tokens(http: aiohttp.ClientSession, replica: SimReplica, **body: Any) -> int:
    status, answer = await post(http, replica, "/tokenize", body)
    assert status == 200
    return int(answer["count"])


async def test_a_prompt_list_gets_n_choices_per_prompt_and_counts_each_prompt_once(
    client: openai.AsyncOpenAI, replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    reply = await client.completions.create(
        model="sim-model", prompt=PROMPTS, n=2, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]  # prompt_index * n + j
    assert all(c.text == " the model served" for c in reply.choices)
    assert reply.usage is not None
    prompt_tokens = sum([await tokens(http, replica, prompt=p) for p in PROMPTS])
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == 4 * 3


async def test_a_list_of_token_id_prompts_is_batched_too(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2}
    status, reply = await post(http, replica, "/v1/completions", body)
    assert status == 200
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["usage"]["prompt_tokens"] == 5


async def test_chat_with_n_returns_n_choices_each_up_to_max_tokens(
    client: openai.AsyncOpenAI, replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    reply = await client.chat.completions.create(
        model="sim-model", messages=CHAT["messages"], n=3, max_tokens=4
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == await tokens(http, replica, **CHAT)
    assert reply.usage.completion_tokens == 12


async def test_each_sequence_is_an_engine_request_that_reuses_the_prompts_cached_blocks(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    prompt = "Shared prompt text for every child request. " * 10
    prompt_tokens = await tokens(http, replica, prompt=prompt)
    status, _ = await post(http, replica, "/v1/completions",
                           {"prompt": prompt, "n": 4, "max_tokens": 1})  # fmt: skip
    assert status == 200
    stats = replica.engine.stats
    assert stats.finished == 4
    assert stats.prefix_cache_hits == 3 * ((prompt_tokens - 1) // 16 * 16)


async def test_streamed_choices_interleave_by_index_with_one_usage_chunk_and_one_done(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 3, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    events = await post_stream(http, replica, "/v1/completions", body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage_events = [e for e in events[:-1] if not e["choices"]]
    assert usage_events == [events[-2]]
    assert events[-2]["usage"]["completion_tokens"] == 12
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for event in events[:-2]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert texts == dict.fromkeys(range(4), " the model served")
    assert finishes == {index: ["length"] for index in range(4)}
    first_four = [e["choices"][0]["index"] for e in events[:4]]
    assert sorted(first_four) == [0, 1, 2, 3]  # every choice's first token before any second


async def test_streamed_chat_choices_each_open_with_the_assistant_role(
    client: openai.AsyncOpenAI,
) -> None:
    stream = await client.chat.completions.create(
        model="sim-model", messages=CHAT["messages"], n=2, max_tokens=2, stream=True
    )
    chunks = [chunk async for chunk in stream]
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    for index in (0, 1):
        content = [c.choices[0].delta.content for c in chunks[2:] if c.choices[0].index == index]
        assert content == [" the", " model"]


async def test_the_context_length_check_applies_to_each_prompt_and_submits_nothing_on_failure(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    half = "word " * 500  # 500 tokens: two fit in 1024 one at a time, not together
    status, _ = await post(http, replica, "/v1/completions",
                           {"prompt": [half, half], "max_tokens": 10})  # fmt: skip
    assert status == 200
    finished = replica.engine.stats.finished
    status, error = await post(http, replica, "/v1/completions",
                               {"prompt": ["short", half * 3], "max_tokens": 10})  # fmt: skip
    assert status == 400
    assert "maximum context length is 1024 tokens" in error["error"]["message"]
    assert replica.engine.stats.finished == finished and replica.engine.stats.aborted == 0


async def test_n_and_best_of_out_of_range_are_400(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    bad_bodies = [
        ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
        ("/v1/chat/completions", {**CHAT, "n": 129}, "n"),
        ("/v1/chat/completions", {**CHAT, "n": "2"}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        ("/v1/completions", {"prompt": ["x", 5]}, "prompt"),
    ]
    for path, body, param in bad_bodies:
        status, answer = await post(http, replica, path, body)
        assert status == 400, body
        assert answer["error"]["type"] == "BadRequestError" and answer["error"]["param"] == param


async def test_best_of_generates_every_sequence_and_returns_the_n_most_likely(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": PROMPTS, "n": 2, "best_of": 5, "max_tokens": 4, "logprobs": 0,
            "ignore_eos": True}  # fmt: skip
    status, reply = await post(http, replica, "/v1/completions", body)
    assert status == 200
    assert replica.engine.stats.finished == 10  # 2 prompts x best_of 5
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    likelihood = [sum(c["logprobs"]["token_logprobs"]) for c in reply["choices"]]
    assert likelihood[0] >= likelihood[1] and likelihood[2] >= likelihood[3]
    assert reply["usage"]["completion_tokens"] == 4 * 4  # the returned choices, as vLLM counts


async def test_client_disconnect_mid_stream_aborts_every_child_request(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(time_scale=0.5, num_gpu_blocks=256, max_model_len=2048)
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    response = await http.post(
        replica.url + "/v1/completions", json=body, headers={"X-Request-Id": "fan"}
    )
    await response.content.readuntil(b"\n\n")  # a first token: every child holds blocks
    async with http.get(replica.url + "/sim/state?requests=1") as state:
        ids = {r["id"] for r in (await state.json())["requests"]}
    assert ids == {"0_fan-0", "1_fan-0", "0_fan-1", "1_fan-1"}  # vLLM's child ids
    response.close()
    await eventually(lambda: not replica.engine.has_unfinished_requests())
    families = await scrape(http, replica)
    assert value(families, "vllm:num_requests_running") == 0
    assert value(families, "vllm:kv_cache_usage_perc") == 0
    assert value(families, "vllm:request_success", "_total", finished_reason="abort") == 4


async def test_client_disconnect_before_a_full_answer_aborts_every_child_request(
    sim_factory: SimFactory,
) -> None:
    replica = await sim_factory(time_scale=0.5, num_gpu_blocks=256, max_model_len=2048)
    body = {**CHAT, "n": 3, "max_tokens": 1000, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(
            session.post(replica.url + "/v1/chat/completions", json=body)
        )
        await eventually(lambda: len(replica.engine.running) == 3)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await eventually(lambda: not replica.engine.has_unfinished_requests())
        families = await scrape(session, replica)
    assert value(families, "vllm:num_requests_running") == 0
    assert value(families, "vllm:kv_cache_usage_perc") == 0
    assert replica.engine.stats.aborted == 3


async def test_a_dropped_connection_aborts_every_child_request(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    replica.faults = Faults(drop_after_chunks=4)
    body = {**CHAT, "n": 3, "max_tokens": 50, "ignore_eos": True, "stream": True}
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
            async for data in response.content.iter_any():
                received += data
    assert received.count(b"data: ") == 4  # three role chunks and one token
    await eventually(lambda: not replica.engine.has_unfinished_requests())
    assert replica.engine.pool.usage() == 0
    assert replica.engine.stats.aborted == 3
