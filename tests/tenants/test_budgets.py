"""Token budgets on the in-memory store: charged the worst case at admission, settled to
actual usage at the end, refunded whole when nothing was generated; requests per minute and
concurrent requests; 429 with Retry-After and OpenAI's six x-ratelimit-* headers.

The stub replica reports prompt_tokens=10 and completion_tokens=min(chunks, max_tokens); kvgate
counts the chat prompt "hi" as 9 tokens (1 + 5 for the ChatML message + 3 for the reply
primer), so a request with max_tokens N is charged 9 + N.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import pytest

from kvgate.state.base import BucketLimit
from kvgate.state.memory import MemoryStore
from tests.plugins.gateway import RunningGateway, gateway_config, openai_error, wait_settled
from tests.plugins.waiting import eventually
from tests.tenants.support import (
    RATE_LIMIT_HEADERS,
    chat,
    concurrency_pool,
    metrics,
    post,
    sample,
    tokens_bucket,
)

PROMPT_ESTIMATE = 9  # kvgate's count of the chat prompt "hi"
PROMPT_ACTUAL = 10  # what the stub reports


def one_tenant(url: str, **limits: Any) -> Any:
    tenant = {"name": "team", **limits}
    return gateway_config(
        [url], auth={"mode": "none", "anonymous_tenant": "team"}, tenants=[tenant]
    )


async def tenant_tokens(session: aiohttp.ClientSession, gw: RunningGateway) -> dict[str, float]:
    samples = await metrics(session, gw.url)
    kinds = ("reserved", "refunded", "prompt", "completion")
    return {
        kind: sample(samples, "kvgate_tenant_tokens_total", tenant="team", kind=kind) or 0.0
        for kind in kinds
    }


async def remaining(gw: RunningGateway, tokens_per_minute: int) -> int:
    state = await gw.store.peek(tokens_bucket("team"), BucketLimit(tokens_per_minute))
    return state.remaining


async def no_concurrency_lease(gw: RunningGateway) -> None:
    """Until the tenant holds no concurrency lease (released as the handler returns)."""

    async def none_held() -> bool:
        return await gw.store.held(concurrency_pool("team")) == 0

    await eventually(none_held, what="the concurrency leases' release")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_worst_case_is_charged_and_the_unused_part_refunded(
    stub_factory, gateway_factory, stream
):
    stub = await stub_factory(chunks=3)
    gw = await gateway_factory(one_tenant(stub.url, tokens_per_minute=6000))
    async with aiohttp.ClientSession() as s:
        reply = await post(s, gw.url, chat(max_tokens=500, stream=stream))
        assert reply.status == 200, reply
        # Charged at admission: the worst case, 9 + 500, out of a full bucket.
        assert reply.headers["x-ratelimit-remaining-tokens"] == str(6000 - 509)
        await wait_settled(gw)
        tokens = await tenant_tokens(s, gw)
    assert tokens == {"reserved": 509, "refunded": 509 - 13, "prompt": 10, "completion": 3}
    # The bucket got the unused 496 back: only the 13 actually used (plus refill) are gone.
    assert 6000 - 13 <= await remaining(gw, 6000) <= 6000


async def test_an_upstream_failure_before_any_token_is_refunded_whole(
    stub_factory, gateway_factory
):
    stub = await stub_factory(status=500)
    gw = await gateway_factory(one_tenant(stub.url, tokens_per_minute=6000))
    async with aiohttp.ClientSession() as s:
        reply = await post(s, gw.url, chat(max_tokens=500))
        assert reply.status == 502, reply
        await wait_settled(gw)
        tokens = await tenant_tokens(s, gw)
    assert tokens == {"reserved": 509, "refunded": 509, "prompt": 0, "completion": 0}
    assert await remaining(gw, 6000) == 6000


async def test_a_client_that_disconnects_mid_stream_pays_the_prompt_and_what_was_streamed(
    stub_factory, gateway_factory
):
    stub = await stub_factory(chunks=50, gate=asyncio.Event())
    gw = await gateway_factory(
        one_tenant(stub.url, tokens_per_minute=6000, max_concurrent=4)
    )
    async with aiohttp.ClientSession() as s:
        response = await s.post(
            f"{gw.url}/v1/chat/completions", json=chat(max_tokens=500, stream=True)
        )
        assert response.status == 200
        first = await response.content.readuntil(b"\n\n")
        assert b"tok0" in first
        response.close()  # the client goes away while the replica is still generating

        async def refunded() -> bool:
            return (await tenant_tokens(s, gw))["refunded"] > 0

        await eventually(refunded, what="the disconnected request's refund")
        await wait_settled(gw)
        await no_concurrency_lease(gw)
        tokens = await tenant_tokens(s, gw)
        samples = await metrics(s, gw.url)
    charged = PROMPT_ESTIMATE + 1  # the prompt as counted, and the one token streamed
    assert tokens == {
        "reserved": 509, "refunded": 509 - charged, "prompt": PROMPT_ESTIMATE, "completion": 1,
    }
    assert 6000 - charged <= await remaining(gw, 6000)
    assert sample(samples, "kvgate_tenant_concurrent_requests", tenant="team") == 0


async def test_over_the_token_budget_is_refused_with_retry_after_and_rate_limit_headers(
    stub_factory, gateway_factory
):
    stub = await stub_factory(chunks=1000)  # the replica uses every token it may
    gw = await gateway_factory(
        one_tenant(stub.url, tokens_per_minute=1000, requests_per_minute=100)
    )
    async with aiohttp.ClientSession() as s:
        first = await post(s, gw.url, chat(max_tokens=600))
        second = await post(s, gw.url, chat(max_tokens=600))
        small = await post(s, gw.url, chat(max_tokens=5))
        whole = await post(s, gw.url, chat(max_tokens=1000))
    assert first.status == 200, first
    for name in RATE_LIMIT_HEADERS:
        assert name in first.headers, name
    assert first.headers["x-ratelimit-limit-tokens"] == "1000"
    assert first.headers["x-ratelimit-limit-requests"] == "100"
    assert first.headers["x-ratelimit-remaining-requests"] == "99"
    assert first.headers["x-ratelimit-remaining-tokens"] == str(1000 - 609)

    assert second.status == 429, second
    error = openai_error(second.body)
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")  # as OpenAI's
    assert "1000 tokens per minute" in error["message"]
    # 610 used, so ~390 left: 609 fit again after ~(609 - 390) / (1000/60 per s) ≈ 13 s.
    assert 11 <= int(second.headers["retry-after"]) <= 15
    assert 11_000 <= int(second.headers["retry-after-ms"]) <= 15_000
    for name in RATE_LIMIT_HEADERS:
        assert name in second.headers, name
    assert 380 <= int(second.headers["x-ratelimit-remaining-tokens"]) <= 400
    assert re.fullmatch(r"\d+s", second.headers["x-ratelimit-reset-tokens"])
    # The refusal cost nothing: a small request still fits, and its request was given back.
    assert small.status == 200, small
    assert small.headers["x-ratelimit-remaining-requests"] == "98"
    assert len(stub.received) == 2

    # A worst case above the whole budget could never be admitted: 400, not a retry loop.
    assert whole.status == 400, whole
    assert openai_error(whole.body)["code"] == "exceeds_token_budget"


async def test_requests_per_minute_are_enforced_with_all_six_headers(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(
        one_tenant(stub.url, tokens_per_minute=100_000, requests_per_minute=3)
    )
    async with aiohttp.ClientSession() as s:
        replies = [await post(s, gw.url, chat()) for _ in range(4)]
    assert [r.status for r in replies] == [200, 200, 200, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in replies] == ["2", "1", "0", "0"]
    refused = replies[-1]
    error = openai_error(refused.body)
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert "3 requests per minute" in error["message"]
    # computed from the bucket's refill (one request per 20 s), not a constant
    assert 15 <= int(refused.headers["retry-after"]) <= 21
    assert 15_000 <= int(refused.headers["retry-after-ms"]) <= 21_000
    for name in RATE_LIMIT_HEADERS:
        assert name in refused.headers, name
    assert refused.headers["x-ratelimit-limit-tokens"] == "100000"
    assert len(stub.received) == 3


async def test_concurrent_requests_over_the_limit_are_refused_and_the_count_returns_to_zero(
    stub_factory, gateway_factory
):
    gate = asyncio.Event()
    stub = await stub_factory(chunks=3, gate=gate)
    gw = await gateway_factory(
        one_tenant(stub.url, max_concurrent=2, tokens_per_minute=100_000, requests_per_minute=60)
    )
    async with aiohttp.ClientSession() as s:
        streams = [
            await s.post(f"{gw.url}/v1/chat/completions", json=chat(stream=True))
            for _ in range(2)
        ]
        for stream in streams:
            assert stream.status == 200
            await stream.content.readuntil(b"\n\n")  # both are generating now
        assert await gw.store.held(concurrency_pool("team")) == 2
        samples = await metrics(s, gw.url)
        assert sample(samples, "kvgate_tenant_concurrent_requests", tenant="team") == 2

        refused = await post(s, gw.url, chat())
        assert refused.status == 429, refused
        error = openai_error(refused.body)
        assert (error["type"], error["code"]) == ("concurrency", "rate_limit_exceeded")
        assert int(refused.headers["retry-after"]) >= 1
        for name in RATE_LIMIT_HEADERS:  # the budgets as they stand, nothing taken
            assert name in refused.headers, name
        assert refused.headers["x-ratelimit-remaining-requests"] == "58"
        assert len(stub.received) == 2

        gate.set()
        for stream in streams:
            assert b"[DONE]" in await stream.read()
            stream.release()
        await wait_settled(gw)
        await no_concurrency_lease(gw)
        samples = await metrics(s, gw.url)
        assert sample(samples, "kvgate_tenant_concurrent_requests", tenant="team") == 0
        again = await post(s, gw.url, chat())
        assert again.status == 200, again


async def test_a_concurrency_refusal_retries_after_the_tenants_typical_request_ends(
    stub_factory, gateway_factory
):
    stub = await stub_factory(chunks=3, delay_headers_s=0.4)  # each request lasts ~0.4 s
    gw = await gateway_factory(one_tenant(stub.url, max_concurrent=2))
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            assert (await post(s, gw.url, chat())).status == 200
        busy = [asyncio.create_task(post(s, gw.url, chat())) for _ in range(2)]

        async def both_in_flight() -> bool:
            return await gw.store.held(concurrency_pool("team")) == 2

        await eventually(both_in_flight, what="two requests in flight")
        refused = await post(s, gw.url, chat())
        await asyncio.gather(*busy)
    assert refused.status == 429, refused
    # two requests of ~0.4 s in flight: one ends every ~0.2 s
    assert 150 <= int(refused.headers["retry-after-ms"]) <= 400
    assert refused.headers["retry-after"] == "1"


class LateAnswers:
    """The in-memory store, whose answers to one operation arrive late: the store has acted
    and the reply is still in transit (as with a slow Redis link)."""

    backend = "memory"

    def __init__(self, operation: str, delay_s: float) -> None:
        self.inner = MemoryStore()
        self.operation = operation
        self.delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if name != self.operation:
            return method

        async def late(*args: Any, **kwargs: Any) -> Any:
            answer = await method(*args, **kwargs)
            await asyncio.sleep(self.delay_s)
            return answer

        return late


async def test_a_client_that_leaves_while_its_budget_is_charged_gets_it_back(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    store = LateAnswers("charge", delay_s=0.5)
    gw = await gateway_factory(
        one_tenant(stub.url, tokens_per_minute=600, max_concurrent=3), store=store
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.1)) as s:
        with pytest.raises(TimeoutError):
            await post(s, gw.url, chat(max_tokens=500))

    async def given_back() -> bool:
        tokens = await store.inner.peek(tokens_bucket("team"), BucketLimit(600))
        held = await store.inner.held(concurrency_pool("team"))
        return tokens.remaining >= 590 and held == 0  # refill alone brings 10 tokens/s

    await eventually(given_back, timeout_s=3, what="the charge and the lease given back")
    assert stub.received == []
