"""When a replica fails: refused connections, silence, 5xx, its own 400s, and streams that
break midway. Each ending is a clear OpenAI-shaped error (or a final SSE error event once a
stream has started), and leaves nothing reserved: the ledger is back to 0, nothing in flight.
"""

from __future__ import annotations

import asyncio
import socket

import orjson

from tests.plugins.client import post
from tests.plugins.gateway import gateway_config, openai_error, wait_settled
from tests.plugins.waiting import eventually

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
STREAM = {**CHAT, "stream": True}
# Discovery that sees a replica once and then not again during the test.
SLOW_DISCOVERY = {"interval_s": 60, "timeout_s": 1.0}


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def sse_events(raw: bytes) -> list[bytes]:
    return [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]


async def test_replica_that_died_after_discovery_gives_502_naming_it(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], discovery=SLOW_DISCOVERY))
    replica = next(iter(gw.gateway.registry))
    assert stub.runner is not None
    await stub.runner.cleanup()  # discovery still believes it healthy
    assert replica.healthy
    for body in (CHAT, STREAM):
        status, _, raw = await post(f"{gw.url}/v1/chat/completions", body)
        assert status == 502
        error = openai_error(raw)
        assert error["code"] == "upstream_error"
        assert replica.id in error["message"]
    await wait_settled(gw)


async def test_no_healthy_replica_gives_503(gateway_factory):
    config = gateway_config([closed_port_url()], models=[{"name": "stub-model"}])
    gw = await gateway_factory(config, wait=False)
    status, _, raw = await post(f"{gw.url}/v1/chat/completions", CHAT)
    assert status == 503
    assert openai_error(raw)["code"] == "no_replica"


async def test_replica_discovery_marks_unhealthy_gives_503_not_404(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))  # discovery every 0.1 s
    replica = next(iter(gw.gateway.registry))
    assert stub.runner is not None
    await stub.runner.cleanup()
    await eventually(lambda: not replica.healthy, timeout_s=3, what="the replica marked down")
    status, _, raw = await post(f"{gw.url}/v1/chat/completions", CHAT)
    assert status == 503, raw
    assert openai_error(raw)["code"] == "no_replica"
    await wait_settled(gw)


async def test_replica_slower_than_first_byte_s_gives_504(stub_factory, gateway_factory):
    stub = await stub_factory(delay_headers_s=5.0)
    timeouts = {"connect_s": 2, "first_byte_s": 0.2, "idle_s": 10, "total_s": 30}
    gw = await gateway_factory(gateway_config([stub.url], timeouts=timeouts))
    for body in (CHAT, STREAM):
        status, _, raw = await post(f"{gw.url}/v1/chat/completions", body)
        assert status == 504
        error = openai_error(raw)
        assert error["code"] == "upstream_timeout"
        assert next(iter(gw.gateway.registry)).id in error["message"]
    await wait_settled(gw)


async def test_replica_500_gives_502_naming_the_replica(stub_factory, gateway_factory):
    stub = await stub_factory(status=500)
    gw = await gateway_factory(gateway_config([stub.url]))
    replica = next(iter(gw.gateway.registry))
    for body in (CHAT, STREAM):
        status, _, raw = await post(f"{gw.url}/v1/chat/completions", body)
        assert status == 502
        error = openai_error(raw)
        assert error["type"] == "upstream_error"
        assert replica.id in error["message"] and "500" in error["message"]
        assert "boom" in error["message"]  # the replica's own words
    await wait_settled(gw)


async def test_replica_503_gives_503(stub_factory, gateway_factory):
    stub = await stub_factory(status=503, error_body=b"overloaded")
    gw = await gateway_factory(gateway_config([stub.url]))
    status, _, raw = await post(f"{gw.url}/v1/chat/completions", CHAT)
    assert status == 503
    error = openai_error(raw)
    assert "overloaded" in error["message"]
    await wait_settled(gw)


async def test_replica_400_is_passed_through_in_openai_shape(stub_factory, gateway_factory):
    # vLLM's older error form puts the fields at the top level.
    vllm_body = orjson.dumps({"object": "error", "message": "guided_json is not a schema",
                              "type": "BadRequestError", "param": None, "code": 400})
    stub = await stub_factory(status=400, error_body=vllm_body)
    gw = await gateway_factory(gateway_config([stub.url]))
    for body in (CHAT, STREAM):
        status, headers, raw = await post(f"{gw.url}/v1/chat/completions", body)
        assert status == 400
        assert headers["content-type"].startswith("application/json")
        error = openai_error(raw)
        assert error["message"] == "guided_json is not a schema"
        assert error["type"] == "BadRequestError"
    assert len(stub.received) == 2
    await wait_settled(gw)


async def test_replica_4xx_in_any_body_shape_reaches_the_client_in_openai_shape(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    bodies = [
        (400, b'{"error": {"code": 400}}', None),
        (400, b'{"error": {"message": "bad thing"}}', "bad thing"),
        (400, b'{"error": "a plain string"}', "a plain string"),
        (400, b'{"error": {"message": "x", "type": "T", "param": null, "code": 1, "extra": 2}}',
         "x"),
        (422, b'{"detail": [{"loc": ["body", "n"], "msg": "bad n"}]}', "bad n"),
        (404, b"Not Found", "Not Found"),
        (400, b"", None),
        (400, b"[1, 2]", None),
        (400, b"null", None),
        (429, b'{"message": "slow down", "type": "RateLimit", "code": 429}', "slow down"),
    ]
    for status, raw_body, text in bodies:
        stub.status, stub.error_body = status, raw_body
        got, _, raw = await post(f"{gw.url}/v1/chat/completions", CHAT)
        assert got == status, raw_body
        error = openai_error(raw)
        if text is not None:
            assert text in error["message"], (raw_body, error)
    await wait_settled(gw)


async def test_replica_400_about_context_length_gets_that_code(stub_factory, gateway_factory):
    body = orjson.dumps({"error": {"message": "This model's maximum context length is 4096 "
                                   "tokens", "type": "BadRequestError", "param": None,
                                   "code": 400}})
    stub = await stub_factory(status=400, error_body=body)
    gw = await gateway_factory(gateway_config([stub.url]))
    status, _, raw = await post(f"{gw.url}/v1/chat/completions", CHAT)
    assert status == 400
    assert openai_error(raw)["code"] == "context_length_exceeded"


async def test_replica_dropping_the_stream_midway_ends_it_with_an_error_event(
    stub_factory, gateway_factory
):
    stub = await stub_factory(chunks=5, drop_after_chunks=2)
    gw = await gateway_factory(gateway_config([stub.url]))
    replica = next(iter(gw.gateway.registry))
    status, _, raw = await post(f"{gw.url}/v1/chat/completions", STREAM)  # reads to a clean end
    assert status == 200
    events = sse_events(raw)
    assert b"tok0" in events[0] and b"tok1" in events[1]
    error = openai_error(events[-1])
    assert error["code"] == "upstream_error" and replica.id in error["message"]
    assert b"[DONE]" not in raw
    await wait_settled(gw)


async def test_replica_dropping_the_stream_before_any_chunk_ends_it_with_an_error_event(
    stub_factory, gateway_factory
):
    stub = await stub_factory(chunks=3, drop_after_chunks=0)
    gw = await gateway_factory(gateway_config([stub.url]))
    status, _, raw = await post(f"{gw.url}/v1/chat/completions", STREAM)
    assert status == 200  # the replica's headers had already been relayed
    events = sse_events(raw)
    assert len(events) == 1
    assert openai_error(events[0])["code"] == "upstream_error"
    await wait_settled(gw)


async def test_replica_answering_invalid_json_gives_502(stub_factory, gateway_factory):
    stub = await stub_factory(raw_body=b'{"choices": [')
    gw = await gateway_factory(gateway_config([stub.url]))
    status, headers, raw = await post(f"{gw.url}/v1/chat/completions", CHAT)
    assert status == 502
    assert "invalid JSON" in openai_error(raw)["message"]
    assert headers["x-request-id"]
    await wait_settled(gw)


async def test_replica_going_silent_mid_stream_ends_it_with_a_timeout_event(
    stub_factory, gateway_factory
):
    stub = await stub_factory(chunks=3, idle_after_first_chunk_s=5.0)
    timeouts = {"connect_s": 2, "first_byte_s": 10, "idle_s": 0.2, "total_s": 30}
    gw = await gateway_factory(gateway_config([stub.url], timeouts=timeouts))
    status, _, raw = await post(f"{gw.url}/v1/chat/completions", STREAM)
    assert status == 200
    events = sse_events(raw)
    assert b"tok0" in events[0]
    assert openai_error(events[-1])["code"] == "upstream_timeout"
    assert len(events) == 2
    await wait_settled(gw)
    await eventually(lambda: stub.cancelled, timeout_s=3, what="kvgate hanging up on the silent replica")
    assert stub.cancelled == 1


async def test_the_gateway_serves_again_once_the_replica_recovers(stub_factory, gateway_factory):
    """After a failed call the replica is not left half-reserved: the next request uses it."""
    stub = await stub_factory(status=500)
    gw = await gateway_factory(gateway_config([stub.url]))
    status, _, _ = await post(f"{gw.url}/v1/chat/completions", CHAT)
    assert status == 502
    stub.status = 200
    status, _, raw = await post(f"{gw.url}/v1/chat/completions", STREAM)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    await wait_settled(gw)


async def test_a_replica_whose_connections_time_out_is_unreachable_and_retried_elsewhere(
    stub_factory, gateway_factory
):
    """A replica that drops connection attempts (a node gone from the network) times out in
    connect: the request never got there, so it goes to another replica, not a 504."""
    dark, other = await stub_factory(), await stub_factory()
    gw = await gateway_factory(gateway_config(
        [], pools={"default": {"replicas": [{"url": dark.url, "name": "dark"},
                                            {"url": other.url, "name": "other"}]}},
        discovery=SLOW_DISCOVERY, routing={"scorers": {"round_robin": 1}},
        timeouts={"connect_s": 0.3, "first_byte_s": 10, "idle_s": 10, "total_s": 30},
    ))
    host, port = dark.url.removeprefix("http://").split(":")
    assert dark.runner is not None
    await dark.runner.cleanup()
    # a listener whose accept queue is full and never drained: the kernel drops further
    # connection attempts, as a vanished host does
    hole = socket.socket()
    hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hole.bind((host, int(port)))
    hole.listen(0)
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex((host, int(port)))
            fillers.append(filler)
        await asyncio.sleep(0.05)
        status, headers, raw = await post(f"{gw.url}/v1/chat/completions", CHAT)
        assert status == 200, raw
        assert headers["x-kvgate-replica"] == "other"
        text = gw.gateway.metrics.render().decode()
        assert 'kvgate_upstream_retries_total{pool="default",reason="unreachable"} 1.0' in text
    finally:
        for filler in fillers:
            filler.close()
        hole.close()
    await wait_settled(gw)
