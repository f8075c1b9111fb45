"""kvgate in front of a real vLLM: what discovery reads, and every kind of answer in the same
shape as the engine gives it directly, with the tenant charged what vLLM reports it used."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kvgate.tools.tiny_model import MODEL_NAME
from tests.plugins.gateway import wait_settled
from tests.real.conftest import real_config, wait_idle

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]  # fmt: skip
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three prime numbers."}]  # fmt: skip


def clients(engine_url: str, gw_url: str) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    direct = openai.AsyncOpenAI(base_url=f"{engine_url}/v1", api_key="x", max_retries=0)
    through = openai.AsyncOpenAI(base_url=f"{gw_url}/v1", api_key="x", max_retries=0)
    return direct, through


def shape(value: Any) -> Any:
    """The keys and types of a JSON value, without its contents (ids, texts, times differ)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__ if value is not None else None


def tenant_tokens(gw: Any, kind: str) -> float:
    return gw.gateway.metrics.registry.get_sample_value(
        "kvgate_tenant_tokens_total", {"tenant": "anonymous", "kind": kind}) or 0.0


async def test_discovery_reads_blocks_block_size_model_length_and_name(engines, gateway_factory):
    gw = await gateway_factory(real_config(engines, ["a", "busy"]))
    replicas = {r.id: r for r in gw.gateway.registry}
    assert replicas["a"].num_gpu_blocks == 256 and replicas["a"].block_size == 32
    assert replicas["busy"].num_gpu_blocks == 64 and replicas["busy"].block_size == 32
    assert replicas["a"].models == {MODEL_NAME}
    assert replicas["a"].max_model_len(MODEL_NAME) == 4096
    assert replicas["busy"].max_model_len(MODEL_NAME) == 63 * 32


@pytest.mark.parametrize("kind", ["chat", "chat-n2", "chat-tools", "completion"])
async def test_an_answer_through_kvgate_has_the_shape_of_the_engines_own(
    engines, gateway_factory, kind
):
    gw = await gateway_factory(real_config(engines, ["a"]))
    direct, through = clients(engines["a"].url, gw.url)
    args: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 24, "seed": 7}
    if kind == "completion":
        call_direct = direct.completions.create
        call_through = through.completions.create
        args["prompt"] = "Once upon a time"
    else:
        call_direct = direct.chat.completions.create  # type: ignore[assignment]
        call_through = through.chat.completions.create  # type: ignore[assignment]
        args["messages"] = MESSAGES
        if kind == "chat-n2":
            args["n"] = 2
        if kind == "chat-tools":
            args.update(tools=TOOLS, tool_choice="none")
    before = tenant_tokens(gw, "prompt"), tenant_tokens(gw, "completion")
    mine = (await call_direct(**args)).model_dump(exclude_unset=True)
    theirs = (await call_through(**args)).model_dump(exclude_unset=True)
    assert shape(theirs) == shape(mine)
    assert len(theirs["choices"]) == len(mine["choices"]) == args.get("n", 1)
    # the same prompt, counted by vLLM; the charge settled to vLLM's own figures
    assert theirs["usage"]["prompt_tokens"] == mine["usage"]["prompt_tokens"]
    await wait_settled(gw)
    charged = (tenant_tokens(gw, "prompt") - before[0], tenant_tokens(gw, "completion") - before[1])
    assert charged == (theirs["usage"]["prompt_tokens"], theirs["usage"]["completion_tokens"])
    await wait_idle(engines["a"])


@pytest.mark.parametrize("include_usage", [True, False])
async def test_a_stream_through_kvgate_is_the_engines_stream(
    engines, gateway_factory, include_usage
):
    gw = await gateway_factory(real_config(engines, ["a"]))
    direct, through = clients(engines["a"].url, gw.url)
    args: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 32,
                            "seed": 3, "stream": True}
    if include_usage:
        args["stream_options"] = {"include_usage": True}

    async def chunks(client: openai.AsyncOpenAI) -> list[dict[str, Any]]:
        return [c.model_dump(exclude_unset=True)
                async for c in await client.chat.completions.create(**args)]

    mine, theirs = await chunks(direct), await chunks(through)
    if not include_usage:
        # vLLM puts system_fingerprint on a stream's last chunk: the usage chunk kvgate asked
        # for and keeps from the client, once the finish chunk before it has gone (a known
        # difference, docs/real-vllm.md)
        mine[-1].pop("system_fingerprint", None)
    assert [shape(c) for c in theirs[:1] + theirs[-2:]] == [shape(c) for c in mine[:1] + mine[-2:]]
    with_usage = [c for c in theirs if c.get("usage")]
    if include_usage:
        assert len(with_usage) == 1 and with_usage[0] is theirs[-1]
        assert theirs[-1]["usage"]["prompt_tokens"] == mine[-1]["usage"]["prompt_tokens"]
    else:  # kvgate asks the engine for usage to settle, and keeps it from the client
        assert with_usage == [] and not any(c.get("usage") for c in mine)
    assert theirs[-1 - include_usage]["choices"][0]["finish_reason"] in {"stop", "length"}
    await wait_settled(gw)
    await wait_idle(engines["a"])
