"""The proxy: relaying answers, streaming as it arrives, cancelling, and what it forwards."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson

from tests.plugins.client import post
from tests.plugins.gateway import gateway_config
from tests.plugins.waiting import eventually

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def test_non_streaming_answer_is_relayed_with_request_id(stub_factory, gateway_factory):
    stub = await stub_factory(chunks=3)
    gw = await gateway_factory(gateway_config([stub.url]))
    status, headers, body = await post(
        f"{gw.url}/v1/chat/completions", CHAT, headers={"X-Request-Id": "req-42"}
    )
    assert status == 200
    data = orjson.loads(body)
    assert data["choices"][0]["message"]["content"] == "tok tok tok "
    assert headers["x-request-id"] == "req-42"
    assert stub.headers_seen[0]["x-request-id"] == "req-42"
    assert headers["x-kvgate-replica"] == stub.url.removeprefix("http://")


async def test_a_cookie_one_replica_set_is_never_sent_with_anyone_elses_request(
    stub_factory, gateway_factory
):
    # kvgate's pooled client serves every client: a cookie jar would carry one client's
    # session cookie into the next client's requests.
    # (by name: aiohttp's default jar ignores cookies from IP addresses, not from a Service)
    stub = await stub_factory(set_cookie="session=alice; Path=/")
    gw = await gateway_factory(gateway_config([stub.url.replace("127.0.0.1", "localhost")]))
    for _ in range(2):
        status, _, _ = await post(f"{gw.url}/v1/chat/completions", CHAT)
        assert status == 200
    assert [h.get("cookie") for h in stub.headers_seen] == [None, None]


async def test_request_id_is_generated_when_absent(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    _, headers, _ = await post(f"{gw.url}/v1/chat/completions", CHAT)
    assert len(headers["x-request-id"]) == 32
    assert stub.headers_seen[0]["x-request-id"] == headers["x-request-id"]


async def test_unknown_fields_pass_through_untouched(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    extras = {"ignore_eos": True, "priority": 3, "chat_template_kwargs": {"enable_thinking": False},
              "guided_json": {"type": "object"}}
    await post(f"{gw.url}/v1/chat/completions", {**CHAT, **extras})
    forwarded = stub.received[0]
    for key, value in extras.items():
        assert forwarded[key] == value


async def test_omitted_max_tokens_is_set_to_the_model_default_and_forwarded(stub_factory, gateway_factory):
    stub = await stub_factory()
    config = gateway_config([stub.url], default_model={"name": "*", "default_max_tokens": 77})
    gw = await gateway_factory(config)
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    status, _, _ = await post(f"{gw.url}/v1/chat/completions", body)
    assert status == 200
    assert stub.received[0]["max_tokens"] == 77


async def test_hop_by_hop_headers_are_stripped_and_replica_key_replaces_authorization(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    config = gateway_config(
        [stub.url], pools={"default": {"replicas": [{"url": stub.url, "api_key": "replica-secret"}]}}
    )
    gw = await gateway_factory(config)
    await post(
        f"{gw.url}/v1/chat/completions", CHAT,
        headers={"Authorization": "Bearer client-key", "Proxy-Authorization": "x",
                 "Upgrade": "h2c", "X-Custom": "kept"},
    )
    seen = stub.headers_seen[0]
    assert seen["authorization"] == "Bearer replica-secret"
    assert "proxy-authorization" not in seen and "upgrade" not in seen
    assert seen["x-custom"] == "kept"


async def test_first_chunk_reaches_the_client_before_the_upstream_finishes(stub_factory, gateway_factory):
    gate = asyncio.Event()
    stub = await stub_factory(chunks=3, gate=gate)
    gw = await gateway_factory(gateway_config([stub.url]))
    async with aiohttp.ClientSession() as session, session.post(
        f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}
    ) as response:
        first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), timeout=5)
        assert b"tok0" in first
        assert stub.finished == 0  # the upstream is still holding its stream open
        gate.set()
        rest = await response.read()
    assert b"tok2" in rest and rest.endswith(b"data: [DONE]\n\n")


async def test_usage_chunk_is_stripped_unless_the_client_asked(stub_factory, gateway_factory):
    stub = await stub_factory(chunks=2)
    gw = await gateway_factory(gateway_config([stub.url]))
    _, _, plain = await post(f"{gw.url}/v1/chat/completions", {**CHAT, "stream": True})
    assert stub.received[0]["stream_options"] == {"include_usage": True}
    assert b'"usage"' not in plain
    _, _, asked = await post(
        f"{gw.url}/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert b'"usage":{"prompt_tokens":10,"completion_tokens":2' in asked


async def test_a_whole_stream_in_one_read_keeps_its_tokens_and_loses_only_the_usage_event(
    stub_factory, gateway_factory
):
    # vLLM under load can hand the proxy many events in one read, the usage event among them:
    # the events before it go as they are, the usage event is stripped unless asked for.
    stub = await stub_factory(chunks=40, one_write=True)
    gw = await gateway_factory(gateway_config([stub.url]))
    body = {**CHAT, "stream": True, "max_tokens": 40}
    for asked in (False, True):
        extra = {"stream_options": {"include_usage": True}} if asked else {}
        status, _, raw = await post(f"{gw.url}/v1/chat/completions", {**body, **extra})
        assert status == 200
        events = [e for e in raw.split(b"\n\n") if e]
        texts = [orjson.loads(e[6:])["choices"][0]["delta"]["content"]
                 for e in events if b'"delta"' in e]
        assert texts == [f"tok{i} " for i in range(40)]
        assert (b'"usage"' in raw) is asked
        assert events[-1] == b"data: [DONE]"
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    completion = [line for line in text.splitlines()
                  if line.startswith("kvgate_tenant_tokens_total") and 'kind="completion"' in line]
    assert [float(line.rsplit(" ", 1)[1]) for line in completion] == [80.0]  # the usage, read


async def test_client_disconnect_cancels_the_upstream_and_releases_the_ledger(
    stub_factory, gateway_factory
):
    gate = asyncio.Event()
    stub = await stub_factory(chunks=3, gate=gate)
    gw = await gateway_factory(gateway_config([stub.url]))
    replica = next(iter(gw.gateway.registry))
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True})
        await response.content.readuntil(b"\n\n")
        assert await gw.store.held(f"ledger:{replica.id}") > 0
        response.close()  # the client goes away mid-stream
    await eventually(lambda: stub.cancelled, timeout_s=2, what="the upstream call cancelled")
    assert stub.cancelled == 1 and stub.finished == 0

    async def released() -> bool:
        return await gw.store.held(f"ledger:{replica.id}") == 0 and not replica.inflight

    await eventually(released, timeout_s=2, what="the ledger released")
    assert await gw.store.held(f"ledger:{replica.id}") == 0
    assert not replica.inflight


async def test_models_lists_each_model_once(stub_factory, gateway_factory):
    a = await stub_factory(model="m1")
    b = await stub_factory(model="m1")
    c = await stub_factory(model="m2")
    gw = await gateway_factory(gateway_config([a.url, b.url, c.url]))
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/v1/models") as r:
        ids = [m["id"] for m in (await r.json())["data"]]
    assert ids == ["m1", "m2"]


async def test_ready_needs_a_healthy_replica_for_every_configured_model(stub_factory, gateway_factory):
    stub = await stub_factory(model="m1")
    config = gateway_config([stub.url], models=[{"name": "m1"}, {"name": "m2"}])
    gw = await gateway_factory(config)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/ready") as r:
            assert r.status == 503
            assert (await r.json())["missing"] == ["m2"]
        async with session.get(f"{gw.url}/health") as r:
            assert r.status == 200


async def test_openai_client_completes_a_chat_and_a_stream(stub_factory, gateway_factory):
    stub = await stub_factory(chunks=4)
    gw = await gateway_factory(gateway_config([stub.url]))
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content == "tok tok tok tok "
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        stream = await client.chat.completions.create(
            model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True,
        )
        pieces = [c.choices[0].delta.content async for c in stream if c.choices]
        assert "".join(p or "" for p in pieces) == "tok0 tok1 tok2 tok3 "
    finally:
        await client.close()
