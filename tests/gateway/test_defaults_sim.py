"""What a user who configured nothing gets, end to end through kvgate to the simulator.

Requests wait for room as they would on vLLM itself (no latency target, up to max_wait_s);
kvgate refuses early only where an operator set a target, and then at arrival; and it never
changes what an answer is: no max_tokens the client did not send.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
import openai
import pytest
from multidict import CIMultiDictProxy

from tests.plugins import bodies
from tests.plugins.bodies import OMIT, SIM_MODEL
from tests.plugins.client import post
from tests.plugins.gateway import gateway_config

# A small replica: 256 blocks, 230 admissible at target_utilization 0.9.
SMALL = dict(num_gpu_blocks=256, max_model_len=2048, time_scale=0.1)
PROMPT = "Tell me about KV caches. " * 34  # about 200 tokens


def chat(max_tokens: int | None = 900, i: int = 0) -> dict:
    return bodies.chat(f"{i} {PROMPT}", model=SIM_MODEL,
                       max_tokens=OMIT if max_tokens is None else max_tokens)


async def post_all(url: str, bodies: list[dict]) -> list[tuple[int, CIMultiDictProxy[str], Any]]:
    """Every body at once; (status, headers, JSON) each."""
    async with aiohttp.ClientSession() as http:
        replies = await asyncio.gather(*(
            post(f"{url}/v1/chat/completions", body, http=http, timeout_s=120) for body in bodies
        ))
    return [(reply.status, reply.headers, reply.json()) for reply in replies]


async def test_sixteen_requests_that_fit_three_at_a_time_all_complete_with_the_defaults(
    sim_factory, gateway_factory
):
    """200 + 900 tokens is 69 blocks: three run at once, the rest queue and wait their turn
    (several seconds), as vLLM would make them wait; none is refused."""
    sim = await sim_factory(**SMALL)
    gw = await gateway_factory(gateway_config([sim.url]))
    results = await post_all(gw.url, [chat(900, i) for i in range(16)])
    assert [status for status, _, _ in results] == [200] * 16, [
        data.get("error") for status, _, data in results if status != 200
    ]
    assert all(data["usage"]["completion_tokens"] == 900 for _, _, data in results)
    # No preemption is promised here: before any answer is known, predicted admission assumes
    # a typical answer (prediction.prior_tokens), and these all run to max_tokens.


async def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context_as_on_vllm(
    sim_factory, gateway_factory
):
    """The simulator answers to max_tokens, or to the end of the context when none is sent:
    through kvgate the answer is as long as vLLM makes it (here past 1,024 tokens), and the
    worst case reserved is the whole context."""
    sim = await sim_factory(num_gpu_blocks=1024, max_model_len=2048, time_scale=0.001)
    gw = await gateway_factory(gateway_config([sim.url], admission={"mode": "worst_case"}))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="sim-model", messages=[{"role": "user", "content": "Write at length."}],
        )
    answer = raw.parse()
    assert answer.usage is not None
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 2048
    assert answer.usage.completion_tokens > 1024
    assert int(raw.headers["x-kvgate-reserved-blocks"]) == 2048 // 16


async def test_a_completion_without_max_tokens_gets_vllms_sixteen_tokens_not_more(
    sim_factory, gateway_factory
):
    sim = await sim_factory(num_gpu_blocks=1024, max_model_len=2048, time_scale=0.001)
    gw = await gateway_factory(gateway_config([sim.url], admission={"mode": "worst_case"}))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as client:
        raw = await client.completions.with_raw_response.create(
            model="sim-model", prompt="Once upon a time"
        )
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 16
    prompt = int(raw.headers["x-kvgate-prompt-tokens"])
    assert int(raw.headers["x-kvgate-reserved-blocks"]) == math.ceil((prompt + 16) / 16)


@pytest.mark.parametrize("mode", ["predicted", "worst_case"])
async def test_without_max_tokens_the_body_is_forwarded_byte_for_byte(
    stub_factory, gateway_factory, mode
):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], admission={"mode": mode}))
    raw = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}]}'
    status, headers, answer = await post(
        f"{gw.url}/v1/chat/completions", raw, headers={"Content-Type": "application/json"}
    )
    assert status == 200, answer
    reserved = int(headers["X-Kvgate-Reserved-Blocks"])
    prompt = int(headers["X-Kvgate-Prompt-Tokens"])
    assert stub.received == [{"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}]
    if mode == "worst_case":
        assert reserved == 4096 // 16  # the stub's whole context
    else:  # nothing known of the answers yet: the prior, not the whole context
        assert reserved == math.ceil((prompt + 256) / 16)


async def test_max_completion_tokens_bounds_the_request_and_is_not_doubled_by_max_tokens(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config(
        [stub.url], tenants=[{"name": "capped", "max_tokens_cap": 100}],
        auth={"mode": "none", "anonymous_tenant": "capped"},
    ))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as client:
        messages = [{"role": "user", "content": "hi"}]
        raw = await client.chat.completions.with_raw_response.create(
            model="stub-model", messages=messages, max_completion_tokens=50,
        )
        prompt = int(raw.headers["x-kvgate-prompt-tokens"])
        assert int(raw.headers["x-kvgate-reserved-blocks"]) == math.ceil((prompt + 50) / 16)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="stub-model", messages=messages, max_completion_tokens=500,
            )
    assert "max_tokens" not in stub.received[0] and stub.received[0]["max_completion_tokens"] == 50
    assert len(stub.received) == 1  # the refused one was never forwarded
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "max_completion_tokens"
    assert error["code"] == "max_tokens_above_cap"


async def test_a_tenants_cap_on_omitted_max_tokens_is_forwarded(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config(
        [stub.url], tenants=[{"name": "capped", "max_tokens_cap": 100}],
        auth={"mode": "none", "anonymous_tenant": "capped"},
    ))
    status, _, _ = (await post_all(gw.url, [{**chat(None), "model": "stub-model"}]))[0]
    assert status == 200 and stub.received[0]["max_tokens"] == 100


async def test_before_any_replica_reports_its_context_a_request_without_max_tokens_gets_503(
    stub_factory, gateway_factory
):
    """Its worst case is the rest of a context nobody has reported: 503, retry shortly, as
    the ledger answers before capacity is known; nothing is forwarded. With max_tokens, or
    with models[].max_model_len configured, it is served."""
    stub = await stub_factory(max_model_len=None)
    gw = await gateway_factory(gateway_config([stub.url]))
    body = {**chat(None), "model": "stub-model"}
    (status, _, data), = await post_all(gw.url, [body])
    assert status == 503 and data["error"]["code"] == "no_replica"
    assert "retry shortly" in data["error"]["message"]
    assert "max_model_len" in data["error"]["message"]
    assert stub.received == []
    (status, _, _), = await post_all(gw.url, [{**body, "max_tokens": 20}])
    assert status == 200

    configured = await gateway_factory(gateway_config(
        [stub.url], models=[{"name": "stub-model", "max_model_len": 1024}],
        admission={"mode": "worst_case"},  # so the reservation shows the bound
    ))
    (status, headers, _), = await post_all(configured.url, [body])
    assert status == 200 and int(headers["X-Kvgate-Reserved-Blocks"]) == 1024 // 16
    assert "max_tokens" not in stub.received[-1]


async def test_with_a_latency_target_an_overloaded_class_is_refused_at_arrival(
    sim_factory, gateway_factory
):
    """Two replicas, 80-block requests: two run on each, and each keeps 70 blocks free — 140
    in all, none of them enough for one more. With a 0.3 s target, what could not start in
    time is refused at once with Retry-After (never after waiting out the target); what is let
    in is served."""
    replicas = [await sim_factory(**{**SMALL, "max_model_len": 2048}) for _ in range(2)]
    gw = await gateway_factory(gateway_config(
        [r.url for r in replicas],
        admission={"mode": "worst_case", "queue": {"ttft_target_s": {"standard": 0.3}}},
        routing={"scorers": {"least_loaded": 1.0}, "sessions": {"affinity_wait_s": 0}},
    ))
    # 200 + 1,064 tokens = 79 blocks... rounded up with the estimate: 80 blocks each
    warm = await post_all(gw.url, [chat(1064, i) for i in range(2)])  # how long requests hold
    assert [s for s, _, _ in warm] == [200, 200]
    results = await post_all(gw.url, [chat(1064, i) for i in range(2, 14)])
    statuses = [s for s, _, _ in results]
    assert set(statuses) == {200, 429} and statuses.count(200) >= 4
    for status, headers, data in results:
        if status == 429:
            assert data["error"]["code"] == "wait_budget_exceeded", data
            assert int(headers["Retry-After"]) >= 1
    for r in replicas:
        assert r.engine.stats.num_preemptions == 0
    for replica in gw.gateway.registry:
        assert await gw.store.held(f"ledger:{replica.id}") == 0
