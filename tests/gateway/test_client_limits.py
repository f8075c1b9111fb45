"""Limits on the client side: malformed HTTP answered in OpenAI's shape with one WARNING per
burst, headers and bodies that trickle in cut off, and a cap on concurrent connections."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from kvgate.api.protocol import gateway_runner
from kvgate.app import build_app
from tests.plugins.gateway import (
    RunningGateway,
    StubUpstream,
    gateway_config,
    openai_error,
    wait_settled,
)
from tests.plugins.waiting import eventually

GatewayAt = Callable[..., Awaitable[int]]
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture
async def gateway_at(
    stub_factory: Callable[..., Awaitable[StubUpstream]],
) -> AsyncIterator[GatewayAt]:
    """Starts kvgate as `kvgate serve` runs it (its runner and limits); returns its port."""
    runners: list[web.AppRunner] = []

    async def start(**server: Any) -> int:
        stub = await stub_factory()
        config = gateway_config([stub.url], server=server)
        runner = gateway_runner(build_app(config), config.server)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return int(runner.addresses[0][1])

    yield start
    for runner in runners:
        await runner.cleanup()


async def exchange(port: int, data: bytes, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """Send raw bytes; the status and body of the answer (0, b"" if closed without one)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = b""

    async def send() -> None:
        with contextlib.suppress(ConnectionError):  # refused before it was all sent
            writer.write(data)
            await writer.drain()

    sending = asyncio.create_task(send())
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await reader.read(65536):
                raw += chunk
    except ConnectionResetError:
        pass  # closed with our data unread: what arrived before the reset still counts
    finally:
        await sending
        writer.close()
    if not raw:
        return 0, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


MALFORMED = [
    ("negative-content-length", CHAT + b"Content-Length: -5\r\n\r\n", 400),
    ("content-length-and-chunked", CHAT + b"Content-Length: 5\r\nTransfer-Encoding: chunked"
     b"\r\n\r\n0\r\n\r\n", 400),
    ("a-2mb-header", CHAT + b"X-Big: " + b"a" * 2_000_000 + b"\r\n\r\n", 431),
    ("thousands-of-headers", CHAT + b"".join(b"X-H%d: v\r\n" % i for i in range(5000))
     + b"\r\n", 431),
    ("bad-request-line", b"POST /v1/chat/completions HTTP/9.9 extra\r\n\r\n", 400),
]


@pytest.mark.parametrize(
    ("data", "status"), [pytest.param(*case[1:], id=case[0]) for case in MALFORMED]
)
async def test_malformed_http_gets_an_openai_shaped_4xx_and_one_warning_per_burst(
    gateway_at: GatewayAt, caplog: pytest.LogCaptureFixture, data: bytes, status: int
) -> None:
    port = await gateway_at()
    caplog.set_level(logging.DEBUG)
    for _ in range(20):
        got, body = await exchange(port, data)
        assert got == status, body[:300]
        openai_error(body)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].levelno == logging.WARNING and warnings[0].exc_info is None
    # every one counted, though logged once
    reason = "request_header_fields_too_large" if status == 431 else "invalid_request"
    _, scrape = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert f'kvgate_client_refusals_total{{reason="{reason}"}} 20.0'.encode() in scrape


async def test_a_header_section_that_trickles_in_is_cut_off(gateway_at: GatewayAt) -> None:
    port = await gateway_at(client_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    closed = False
    try:
        writer.write(CHAT + b"X-Slow: ")
        for _ in range(200):  # a byte every 50 ms, within every size limit: 10 s unless cut off
            writer.write(b"v")
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), 0.05) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
    except ConnectionResetError:
        closed = True
    finally:
        writer.close()
    assert closed, "kvgate kept reading a header section that never ended"


async def test_a_body_that_trickles_in_is_answered_408(gateway_at: GatewayAt) -> None:
    port = await gateway_at(client_timeout_s=0.3)
    body = orjson.dumps({"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]})
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(CHAT + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body[:5])
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            payload = await reader.readexactly(length)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert openai_error(payload)["code"] == "request_timeout"


async def test_connections_beyond_the_cap_are_refused_with_503(gateway_at: GatewayAt) -> None:
    port = await gateway_at(max_connections=2)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    try:
        await asyncio.sleep(0.05)  # let the server accept both
        status, body = await exchange(port, CHAT + b"Content-Length: 0\r\n\r\n")
        assert status == 503
        assert openai_error(body)["code"] == "too_many_connections"
        refused = b'kvgate_client_refusals_total{reason="too_many_connections"}'
    finally:
        for _, writer in held:
            writer.close()
    # once they are gone, a new client is served again
    async def served() -> bool:
        status, _ = await exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return status == 200

    await eventually(served, timeout_s=2, what="a new client served again")
    _, scrape = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert refused in scrape


async def test_a_client_that_stops_reading_a_stream_is_cut_off_after_the_idle_timeout(
    stub_factory: Callable[..., Awaitable[StubUpstream]],
    gateway_factory: Callable[..., Awaitable[RunningGateway]],
) -> None:
    """The replica streams far more than the socket buffers hold; the client reads the
    headers and stops. kvgate holds at most its transport's buffer, and once a write has
    waited idle_s it lets go: the reservation is released long before total_s."""
    stub = await stub_factory(chunks=400_000, max_model_len=1_000_000, num_gpu_blocks=100_000)
    gw = await gateway_factory(gateway_config([stub.url], timeouts={
        "connect_s": 2, "first_byte_s": 10, "idle_s": 0.5, "total_s": 120}))
    body = orjson.dumps({"model": "stub-model", "stream": True, "max_tokens": 400_000 - 100,
                         "messages": [{"role": "user", "content": "hi"}]})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(CHAT + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        # ... and reads nothing more
        await wait_settled(gw, timeout_s=20)
        assert stub.finished == 0  # the replica's stream was abandoned, not completed
    finally:
        writer.close()
