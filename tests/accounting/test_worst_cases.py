"""Worst cases are true bounds for every shape of request vLLM accepts, end to end.

Through kvgate to the simulator with the official client: a completions call with several
prompts and n > 1 reserves (Σ prompts + k × max_tokens) × n; an image part is reserved at its
configured cost; and the request shapes clients send (n, logprobs, a named tool, JSON mode)
come back as they would from vLLM.
"""

from __future__ import annotations

import json
import math

import openai
import pytest

from tests.plugins.gateway import gateway_config


@pytest.fixture
async def client(sim_factory, gateway_factory):
    sim = await sim_factory(num_gpu_blocks=4096, max_model_len=4096, time_scale=0.001)
    gw = await gateway_factory(gateway_config(
        [sim.url], models=[{"name": "sim-model", "media_part_tokens": 700}],
    ))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as c:
        yield c


async def test_several_prompts_with_n_reserve_every_sequence(client):
    prompts = ["The ledger counts blocks.", "Preemption recomputes " * 20, "短い"]
    raw = await client.completions.with_raw_response.create(
        model="sim-model", prompt=prompts, n=2, max_tokens=100, extra_body={"ignore_eos": True},
    )
    completion = raw.parse()
    assert len(completion.choices) == 6
    estimate = int(raw.headers["x-kvgate-prompt-tokens"])
    reserved = int(raw.headers["x-kvgate-reserved-blocks"])
    assert reserved == math.ceil((estimate + 3 * 100) * 2 / 16)
    usage = completion.usage
    assert usage is not None and usage.completion_tokens == 6 * 100
    # the bound holds: every sequence holds its prompt and its 100 tokens at most
    assert (usage.prompt_tokens * 2 + usage.completion_tokens) <= reserved * 16


async def test_an_image_part_is_reserved_at_its_configured_cost(client):
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    with_image = await client.chat.completions.with_raw_response.create(
        model="sim-model", messages=[{"role": "user", "content": content}], max_tokens=10,
    )
    text_only = await client.chat.completions.with_raw_response.create(
        model="sim-model", messages=[{"role": "user", "content": content[:1]}], max_tokens=10,
    )
    extra = (int(with_image.headers["x-kvgate-prompt-tokens"])
             - int(text_only.headers["x-kvgate-prompt-tokens"]))
    assert extra == 700


async def test_the_shapes_clients_send_come_back_as_from_vllm(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    several = await client.chat.completions.create(
        model="sim-model", messages=messages, n=3, max_tokens=5, logprobs=True, top_logprobs=2,
    )
    assert [c.index for c in several.choices] == [0, 1, 2]
    logprobs = several.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 5 and len(logprobs.content[0].top_logprobs) == 2

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    called = await client.chat.completions.create(
        model="sim-model", messages=messages, tools=[tool], max_tokens=8,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls = called.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather"
    json.loads(calls[0].function.arguments)

    structured = await client.chat.completions.create(
        model="sim-model", messages=messages, max_tokens=8,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(structured.choices[0].message.content or ""), dict)

    stream = await client.chat.completions.create(
        model="sim-model", messages=messages, max_tokens=4, n=2, stream=True,
        stream_options={"include_usage": True},
    )
    indices, usage = set(), None
    async for chunk in stream:
        indices |= {c.index for c in chunk.choices}
        usage = chunk.usage or usage
    assert indices == {0, 1} and usage is not None and usage.completion_tokens == 8
