"""Logprobs, a named tool call and JSON content, through real HTTP as clients see them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
import openai
import pytest

from kvgate.sim.server import SimReplica
from tests.plugins import bodies
from tests.plugins.bodies import OMIT
from tests.plugins.sim import SimFactory
from tests.sim.helpers import FAST, ok, post, post_stream

MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]
WEATHER: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
async def client(replica: SimReplica) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x") as c:
        yield c


chat = partial(bodies.chat, model=OMIT, messages=MESSAGES, max_tokens=5, ignore_eos=True)


# ---------------------------------------------------------------------------- logprobs


async def test_chat_logprobs_list_each_token_with_its_top_alternatives(
    client: openai.AsyncOpenAI,
) -> None:
    reply = await client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [e.token for e in logprobs.content] == [" the", " model", " served", " a", " request"]
    for entry in logprobs.content:
        assert entry.logprob < 0
        assert entry.bytes == list(entry.token.encode())
        top = entry.top_logprobs
        assert len(top) == 3 and top[0].token == entry.token and top[0].logprob == entry.logprob
        assert len({t.token for t in top}) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)


async def test_logprobs_without_top_logprobs_list_no_alternatives(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    reply = await ok(http, replica, "/v1/chat/completions", chat(logprobs=True))
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(e["top_logprobs"] == [] for e in content)
    plain = await ok(http, replica, "/v1/chat/completions", chat())
    assert plain["choices"][0]["logprobs"] is None


async def test_logprobs_are_the_same_for_a_seed_and_differ_across_seeds(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    async def values(replica: SimReplica) -> list[float]:
        reply = await ok(http, replica, "/v1/chat/completions", chat(logprobs=True))
        return [e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]]

    first, same, other = [await sim_factory(**FAST, seed=seed) for seed in (3, 3, 4)]
    assert await values(first) == await values(same)
    assert await values(first) != await values(other)


async def test_streamed_chat_chunks_carry_the_logprobs_of_their_tokens(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    body = chat(logprobs=True, top_logprobs=2)
    whole = await ok(http, replica, "/v1/chat/completions", body)
    events = await post_stream(http, replica, "/v1/chat/completions", body)
    streamed = [e for ev in events[1:-1] for e in ev["choices"][0]["logprobs"]["content"]]
    assert streamed == whole["choices"][0]["logprobs"]["content"]
    assert all(len(ev["choices"][0]["logprobs"]["content"]) == 1 for ev in events[1:-1])


async def test_completion_logprobs_have_tokens_offsets_and_k_plus_one_candidates(
    client: openai.AsyncOpenAI,
) -> None:
    reply = await client.completions.create(
        model="sim-model", prompt="Once", max_tokens=4, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens == [" the", " model", " served", " a"]
    assert logprobs.text_offset == [0, 4, 10, 17]
    assert logprobs.token_logprobs is not None and all(v < 0 for v in logprobs.token_logprobs)
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3 and top[token] == value and max(top.values()) == value


async def test_streamed_completion_logprobs_continue_the_text_offsets(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": "Once", "max_tokens": 4, "logprobs": 1, "ignore_eos": True}
    whole = await ok(http, replica, "/v1/completions", body)
    events = await post_stream(http, replica, "/v1/completions", body)
    offsets = [o for ev in events[:-1] for o in ev["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"] == [0, 4, 10, 17]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
    ],
)
async def test_invalid_logprob_requests_are_vllm_shaped_400s(
    replica: SimReplica, http: aiohttp.ClientSession, path: str, extra: Any, param: str
) -> None:
    body = chat(**extra) if "chat" in path else {"prompt": "x", **extra}
    status, answer = await post(http, replica, path, body)
    assert status == 400
    assert answer["error"]["type"] == "BadRequestError"
    assert answer["error"]["code"] == 400 and answer["error"]["param"] == param


# ---------------------------------------------------------------------------- tool calls


async def test_a_named_tool_choice_calls_it_with_json_arguments_of_the_generated_tokens(
    client: openai.AsyncOpenAI,
) -> None:
    reply = await client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=5, tools=TOOLS, tool_choice=WEATHER,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"input": " the model served a request"}
    assert reply.usage is not None and reply.usage.completion_tokens == 5


async def test_a_streamed_tool_call_comes_in_openais_delta_shape(
    client: openai.AsyncOpenAI,
) -> None:
    stream = await client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=5, tools=TOOLS, tool_choice=WEATHER,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    calls = [c.choices[0].delta.tool_calls for c in chunks[1:]]
    assert all(call is not None and len(call) == 1 for call in calls)
    header, *fragments = (call[0] for call in calls if call is not None)
    assert header.id is not None and header.id.startswith("chatcmpl-tool-")
    assert header.type == "function"
    assert header.function is not None and header.function.name == "get_weather"
    assert header.function.arguments == ""
    assert len(fragments) == 5  # one argument fragment per generated token
    assert all(f.id is None and f.function is not None and f.function.name is None
               for f in fragments)  # fmt: skip
    arguments = "".join(f.function.arguments or "" for f in fragments if f.function)
    assert json.loads(arguments) == {"input": " the model served a request"}
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


async def test_tool_choice_naming_a_tool_not_in_tools_is_400(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    other = {"type": "function", "function": {"name": "launch"}}
    for body in (chat(tools=TOOLS, tool_choice=other), chat(tool_choice=WEATHER),
                 chat(tools=TOOLS, tool_choice="sometimes"),
                 chat(tools=[{"type": "function"}], tool_choice=WEATHER)):  # fmt: skip
        status, answer = await post(http, replica, "/v1/chat/completions", body)
        assert status == 400, body
        assert answer["error"]["type"] == "BadRequestError"


async def test_auto_none_and_absent_tool_choice_answer_content_and_required_calls_the_first(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    for tool_choice in ("auto", "none", None):
        reply = await ok(http, replica, "/v1/chat/completions",
                         chat(tools=TOOLS, tool_choice=tool_choice))  # fmt: skip
        message = reply["choices"][0]["message"]
        assert message["content"] == " the model served a request" and message["tool_calls"] == []
    reply = await ok(http, replica, "/v1/chat/completions",
                     chat(tools=TOOLS, tool_choice="required"))  # fmt: skip
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"


async def test_tools_count_in_the_prompt_tokens_exactly_as_tokenize_counts_them(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    tools_body = {"messages": MESSAGES, "tools": TOOLS}
    tokenized = await ok(http, replica, "/tokenize", tools_body)
    without = await ok(http, replica, "/tokenize", {"messages": MESSAGES})
    assert tokenized["count"] > without["count"] + 50
    reply = await ok(http, replica, "/v1/chat/completions",
                     chat(tools=TOOLS, tool_choice=WEATHER))  # fmt: skip
    assert reply["usage"]["prompt_tokens"] == tokenized["count"]


# ---------------------------------------------------------------------------- JSON content


@pytest.mark.parametrize(
    "response_format",
    [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}],
)
async def test_json_response_format_makes_the_content_json_whole_and_streamed(
    client: openai.AsyncOpenAI, response_format: Any
) -> None:
    for max_tokens in (1, 6):
        reply = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=max_tokens,
            response_format=response_format, extra_body={"ignore_eos": True},
        )  # fmt: skip
        content = reply.choices[0].message.content
        assert content is not None and isinstance(json.loads(content), dict)
        assert reply.usage is not None and reply.usage.completion_tokens == max_tokens
        stream = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=max_tokens, stream=True,
            response_format=response_format, extra_body={"ignore_eos": True},
        )  # fmt: skip
        pieces = [c.choices[0].delta.content async for c in stream if c.choices]
        assert len(pieces) == 1 + max_tokens  # the role chunk's "" and one per token
        assert "".join(p or "" for p in pieces) == content


async def test_text_response_format_is_plain_and_any_other_is_400(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    reply = await ok(http, replica, "/v1/chat/completions",
                     chat(response_format={"type": "text"}))  # fmt: skip
    assert reply["choices"][0]["message"]["content"] == " the model served a request"
    bad_formats: list[Any] = [{"type": "xml"}, "json", {"schema": {}}]
    for bad in bad_formats:
        status, answer = await post(http, replica, "/v1/chat/completions",
                                    chat(response_format=bad))  # fmt: skip
        assert status == 400 and answer["error"]["param"] == "response_format"
