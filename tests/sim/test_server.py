"""The simulated replica through real HTTP: vLLM's OpenAI-compatible API, as clients see it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from kvgate.sim.server import SimReplica
from tests.plugins.sim import SimFactory
from tests.sim.helpers import FAST

MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a terse assistant. " * 8},
    {"role": "user", "content": "Say something."},
]


@pytest.fixture
async def client(replica: SimReplica) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x") as c:
        yield c


async def test_openai_client_gets_a_chat_completion_with_usage(
    client: openai.AsyncOpenAI, replica: SimReplica
) -> None:
    reply = await client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=5
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == " the model served a request"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    prompt_tokens = len(replica.encoder.encode_chat(MESSAGES))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 5)
    assert reply.usage.total_tokens == prompt_tokens + 5


async def test_openai_client_streams_one_chunk_per_token_then_usage(
    client: openai.AsyncOpenAI,
) -> None:
    stream = await client.chat.completions.create(
        model="sim-model",
        messages=MESSAGES,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    tokens = [c.choices[0].delta.content for c in chunks[1:5]]
    assert tokens == [" the", " model", " served", " a"]
    assert [c.choices[0].finish_reason for c in chunks[1:5]] == [None, None, None, "length"]
    assert chunks[5].choices == []
    assert chunks[5].usage is not None and chunks[5].usage.completion_tokens == 4
    assert len(chunks) == 6


async def test_a_stream_without_include_usage_has_no_usage_chunk_and_ends_with_done(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    body = {"model": "sim-model", "messages": MESSAGES, "max_tokens": 2, "stream": True}
    async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = (await response.text()).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [orjson.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert len(payloads) == 3
    assert all(p["choices"] for p in payloads)


async def test_openai_client_gets_text_completions_streamed_and_not(
    client: openai.AsyncOpenAI,
) -> None:
    reply = await client.completions.create(model="sim-model", prompt="Once upon a time")
    assert reply.object == "text_completion"
    assert reply.usage is not None and reply.usage.completion_tokens == 16  # vLLM's default
    stream = await client.completions.create(
        model="sim-model", prompt="Once upon a time", max_tokens=3, stream=True
    )
    texts = [chunk.choices[0].text async for chunk in stream]
    assert texts == [" the", " model", " served"]


async def test_chat_without_max_tokens_may_fill_the_context(sim_factory: SimFactory) -> None:
    replica = await sim_factory(time_scale=0.0, num_gpu_blocks=64, max_model_len=64)
    async with openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x") as client:
        reply = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 64


async def test_context_length_overflow_is_vllms_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=5000
        )
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict)
    assert "maximum context length is 1024 tokens" in body["message"]
    assert "5000 in the completion" in body["message"]
    assert body["type"] == "BadRequestError" and body["code"] == 400


async def test_unknown_model_is_404_and_unknown_fields_are_ignored(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    url = replica.url + "/v1/chat/completions"
    async with http.post(url, json={"model": "gpt-9", "messages": MESSAGES}) as response:
        assert response.status == 404
        error = (await response.json())["error"]
    assert error["message"] == "The model `gpt-9` does not exist."
    assert error["type"] == "NotFoundError"
    body = {"messages": MESSAGES, "max_tokens": 1, "top_k": 5, "frobnicate": {"x": 1}}
    async with http.post(url, json=body) as response:
        assert response.status == 200


async def test_non_zero_priority_is_rejected_without_priority_scheduling(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, "priority": 1}
    async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 400
        assert "Priority scheduling is not enabled" in (await response.json())["error"]["message"]


async def test_under_priority_scheduling_a_request_waits_behind_better_priorities(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    """--scheduling-policy priority: `priority` reaches the engine (lower runs first)."""
    replica = await sim_factory(**FAST, scheduling_policy="priority", max_num_seqs=1)
    url = replica.url + "/v1/chat/completions"
    engine = replica.runtime.engine
    async with http.post(url, json={"messages": MESSAGES, "max_tokens": 1, "priority": 7}) as r:
        assert r.status == 200
    async with http.post(url, json={"messages": MESSAGES, "max_tokens": 1, "priority": "1"}) as r:
        assert r.status == 400
    assert engine.stats.finished == 1  # the priority 7 one ran; the string was refused


async def test_invalid_bodies_are_400(replica: SimReplica, http: aiohttp.ClientSession) -> None:
    url = replica.url + "/v1/chat/completions"
    for data in (b"{not json", b"[1, 2]", orjson.dumps({"messages": "hi"})):
        async with http.post(url, data=data) as response:
            assert response.status == 400
    body = {"messages": MESSAGES, "max_tokens": 0}
    async with http.post(url, json=body) as response:
        assert response.status == 400


async def test_x_request_id_names_the_response_and_is_echoed(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1}
    headers = {"X-Request-Id": "trace-42"}
    async with http.post(
        replica.url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.headers["X-Request-Id"] == "trace-42"
        assert (await response.json())["id"] == "chatcmpl-trace-42"


async def test_api_key_guards_v1_paths_only(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(**FAST, api_key="sekret")
    async with http.get(replica.url + "/v1/models") as response:
        assert response.status == 401
        assert await response.json() == {"error": "Unauthorized"}
    auth = {"Authorization": "Bearer sekret"}
    async with http.get(replica.url + "/v1/models", headers=auth) as response:
        assert response.status == 200
    async with http.get(replica.url + "/health") as response:
        assert response.status == 200


async def test_models_list_the_served_model_with_max_model_len(
    client: openai.AsyncOpenAI, replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim-model"]
    async with http.get(replica.url + "/v1/models") as response:
        card = (await response.json())["data"][0]
    assert card["max_model_len"] == 1024 and card["owned_by"] == "vllm"


async def test_health_is_200_with_an_empty_body(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    async with http.get(replica.url + "/health") as response:
        assert response.status == 200
        assert await response.read() == b""


async def test_tokenize_and_detokenize_round_trip(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    async with http.post(replica.url + "/tokenize", json={"prompt": "Hello world"}) as response:
        tokenized = await response.json()
    assert tokenized["count"] == len(tokenized["tokens"]) == 2
    assert tokenized["max_model_len"] == 1024
    async with http.post(
        replica.url + "/detokenize", json={"tokens": tokenized["tokens"]}
    ) as response:
        assert await response.json() == {"prompt": "Hello world"}
    async with http.post(replica.url + "/tokenize", json={"messages": MESSAGES}) as response:
        chat = await response.json()
    assert chat["tokens"] == replica.encoder.encode_chat(MESSAGES)


async def test_repeated_system_prompts_hit_the_prefix_cache_and_a_trailing_space_misses(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    async def send(system: str) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
        body = {"messages": messages, "max_tokens": 1}
        async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200

    async def state() -> dict[str, Any]:
        async with http.get(replica.url + "/sim/state") as response:
            result: dict[str, Any] = await response.json()
            return result

    system = "You answer questions about KV caches. " * 20
    system_tokens = len(replica.encoder.encode_chat([{"role": "system", "content": system}], False))
    await send(system)
    assert (await state())["prefix_cache_hits"] == 0
    await send(system)
    after_repeat = await state()
    assert after_repeat["prefix_cache_hits"] >= system_tokens // 16 * 16  # its full blocks
    await send(" " + system)
    assert (await state())["prefix_cache_hits"] == after_repeat["prefix_cache_hits"]


async def test_tokenize_shows_five_tokens_per_message_and_three_for_the_generation_prompt(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    async def count(body: dict[str, Any]) -> tuple[int, list[int]]:
        async with http.post(replica.url + "/tokenize", json=body) as response:
            answer = await response.json()
        return answer["count"], answer["tokens"]

    content = "How many KV blocks does a 4096-token prompt hold?"
    text_tokens, _ = await count({"prompt": content})
    one, ids = await count(
        {"messages": [{"role": "user", "content": content}], "add_generation_prompt": False}
    )
    assert one == text_tokens + 5  # <|im_start|> user \n ... <|im_end|> \n
    assert (ids[0], ids[-2]) == (100264, 100265)
    two, _ = await count({"messages": [{"role": "system", "content": content},
                                       {"role": "user", "content": content}],
                          "add_generation_prompt": False})  # fmt: skip
    assert two == 2 * (text_tokens + 5)
    with_reply, ids = await count({"messages": [{"role": "user", "content": content}]})
    assert with_reply == one + 3  # <|im_start|> assistant \n
    async with http.post(replica.url + "/detokenize", json={"tokens": ids}) as response:
        text = (await response.json())["prompt"]
    assert text == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
