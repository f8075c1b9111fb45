"""Each request's record of the books: headers, outcome labels, identity, the access log."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import aiohttp

from tests.accounting.clients import hang_up_at_done
from tests.plugins.gateway import gateway_config, wait_settled
from tests.plugins.waiting import eventually
from tests.tenants.support import chat, metrics, post, sample

HI_TOKENS = 9  # "hi" in one ChatML message: 1 text + 5 per message + 3 for the reply primer


async def test_forwarded_responses_say_the_estimate_and_the_reserved_blocks(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    async with aiohttp.ClientSession() as s:
        reply = await post(s, gw.url, chat(max_tokens=100))
    assert reply.status == 200
    assert reply.headers["x-kvgate-prompt-tokens"] == str(HI_TOKENS)
    assert reply.headers["x-kvgate-reserved-blocks"] == str(math.ceil((HI_TOKENS + 100) / 16))


async def test_the_accounting_headers_can_be_turned_off(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], server={"accounting_headers": False}))
    async with aiohttp.ClientSession() as s:
        reply = await post(s, gw.url, chat())
    assert reply.status == 200 and "x-kvgate-prompt-tokens" not in reply.headers


async def test_two_requests_with_one_client_request_id_are_two_requests_in_flight(
    stub_factory, gateway_factory
):
    gate = asyncio.Event()
    stub = await stub_factory(gate=gate)
    gw = await gateway_factory(gateway_config([stub.url]))
    headers = {"X-Request-Id": "same-id"}
    async with aiohttp.ClientSession() as s:
        url = f"{gw.url}/v1/chat/completions"
        streams = [await s.post(url, json=chat(stream=True), headers=headers) for _ in range(2)]
        for stream in streams:
            await stream.content.readuntil(b"\n\n")
        (replica,) = gw.gateway.registry
        assert len(replica.inflight) == 2
        assert all(r.headers["X-Request-Id"] == "same-id" for r in streams)
        assert [h["x-request-id"] for h in stub.headers_seen] == ["same-id", "same-id"]
        gate.set()
        for stream in streams:
            await stream.read()
            stream.release()
    await wait_settled(gw)


async def test_a_client_that_hangs_up_after_done_is_counted_ok(stub_factory, gateway_factory):
    stub = await stub_factory(chunks=4)
    gw = await gateway_factory(gateway_config([stub.url]))
    body = {**chat(stream=True), "model": "stub-model"}
    for _ in range(20):
        assert await hang_up_at_done(gw.url, body)
    await wait_settled(gw)
    async with aiohttp.ClientSession() as s:
        samples = await metrics(s, gw.url)
    labels = dict(model="stub-model", pool="default", tenant="anonymous")
    assert sample(samples, "kvgate_requests_total", **labels, outcome="ok") == 20
    assert sample(samples, "kvgate_requests_total", **labels, outcome="disconnected") is None


async def test_only_requests_that_waited_are_counted_as_queued(stub_factory, gateway_factory):
    gate = asyncio.Event()
    # 20 blocks, 90% admissible = 18: one request of ceil((9 + 200) / 16) = 14 blocks at a time
    stub = await stub_factory(num_gpu_blocks=20, gate=gate)
    gw = await gateway_factory(gateway_config([stub.url]))
    async with aiohttp.ClientSession() as s:
        url = f"{gw.url}/v1/chat/completions"
        first = await s.post(url, json=chat(max_tokens=200, stream=True))
        await first.content.readuntil(b"\n\n")
        second = asyncio.create_task(post(s, gw.url, chat(max_tokens=200)))
        queue = gw.gateway.admission.pool("default").queue
        await eventually(lambda: len(queue) == 1, what="the second queued behind the first")
        gate.set()
        await first.read()
        first.release()
        assert (await second).status == 200
        samples = await metrics(s, gw.url)
    replica = gw.gateway.registry.in_pool("default")[0].id
    labels = dict(pool="default", replica=replica)
    assert sample(samples, "kvgate_admissions_total", **labels, queued="no") == 1
    assert sample(samples, "kvgate_admissions_total", **labels, queued="yes") == 1


async def test_the_access_log_carries_the_books_of_each_request(
    stub_factory, gateway_factory, caplog
):
    stub = await stub_factory(chunks=3)
    gw = await gateway_factory(gateway_config([stub.url], server={"access_log": True}))
    async with aiohttp.ClientSession() as s:
        with caplog.at_level(logging.INFO, logger="kvgate.access"):
            reply = await post(s, gw.url, chat(max_tokens=50, stream=True),
                               headers={"X-Request-Id": "abc", "Authorization": "Bearer sk-1"})

            async def logged() -> bool:  # a stream is logged once its handler returns
                return any(r.name == "kvgate.access" for r in caplog.records)

            await eventually(logged, what="the access-log line")
    assert reply.status == 200
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvgate.access"]
    record = json.loads(line)
    assert record["request_id"] == "abc" and record["outcome"] == "ok" and record["status"] == 200
    assert record["prompt_tokens"] == HI_TOKENS and record["max_tokens"] == 50
    assert record["reserved_blocks"] == math.ceil((HI_TOKENS + 50) / 16)
    assert record["worst_case_blocks"] == math.ceil((HI_TOKENS + 50) / 16)
    assert record["queue_wait_s"] >= 0 and record["refusal_reason"] is None
    assert 0 < record["ttft_s"] <= record["duration_s"]
    assert "sk-1" not in line
    assert record["charged_tokens"] == 10 + 3  # the stub's usage: 10 prompt, 3 completion
    assert record["replica"] == gw.gateway.registry.in_pool("default")[0].id
    assert "messages" not in line and "hi" not in record.values()


async def test_a_refused_request_is_logged_with_its_reason(stub_factory, gateway_factory, caplog):
    stub = await stub_factory(max_model_len=100)
    gw = await gateway_factory(gateway_config([stub.url], server={"access_log": True}))
    async with aiohttp.ClientSession() as s:
        with caplog.at_level(logging.INFO, logger="kvgate.access"):
            reply = await post(s, gw.url, chat(max_tokens=500))
    assert reply.status == 400
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvgate.access"]
    record = json.loads(line)
    assert (record["outcome"], record["refusal_reason"]) == ("refused", "context_length_exceeded")
    assert record["replica"] is None and record["ttft_s"] is None
