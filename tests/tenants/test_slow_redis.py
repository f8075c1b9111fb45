"""Redis slow rather than down: kvgate's store timeout bounds what a request waits for it.

A proxy between kvgate and Redis holds every byte `delay_s` once it is made slow; with
`state.timeout_s` far below that, each request is answered long before one Redis round trip
could finish (fail_open: from local limits), and nothing is left held once Redis is fast again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from tests.plugins.gateway import gateway_config, wait_released
from tests.tenants.support import chat, post

pytestmark = pytest.mark.redis

DELAY_S = 2.0  # one slow Redis round trip
STORE_TIMEOUT_S = 0.1


@dataclass
class SlowProxy:
    """A TCP proxy to `target` that, while `slow`, delays every chunk each way by delay_s."""

    target: tuple[str, int]
    delay_s: float = DELAY_S
    slow: bool = False
    port: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if self.slow:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        for pipe in (self._pipe(reader, up_writer), self._pipe(up_reader, writer)):
            task = asyncio.ensure_future(pipe)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


@contextlib.asynccontextmanager
async def slow_proxy(redis_url: str) -> AsyncIterator[SlowProxy]:
    host_port = redis_url.split("://", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    proxy = SlowProxy((host, int(port)))
    server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
    proxy.port = server.sockets[0].getsockname()[1]
    try:
        yield proxy
    finally:
        server.close()
        for task in list(proxy.tasks):
            task.cancel()
        await asyncio.gather(*proxy.tasks, return_exceptions=True)
        await server.wait_closed()


async def test_a_slow_redis_delays_no_request_beyond_the_store_timeout(
    redis_url: str, key_prefix: str, stub_factory, gateway_factory
) -> None:
    stub = await stub_factory(chunks=3)
    async with slow_proxy(redis_url) as proxy:
        gw = await gateway_factory(gateway_config(
            [stub.url],
            auth={"mode": "none", "anonymous_tenant": "team"},
            tenants=[{"name": "team", "tokens_per_minute": 1_000_000, "max_concurrent": 50}],
            state={"backend": "redis", "redis_url": f"redis://127.0.0.1:{proxy.port}/0",
                   "key_prefix": key_prefix, "failure_mode": "fail_open",
                   "timeout_s": STORE_TIMEOUT_S},
        ))
        async with aiohttp.ClientSession() as session:
            assert (await post(session, gw.url, chat(stream=True))).status == 200
            proxy.slow = True
            durations = []

            async def one() -> None:
                started = time.monotonic()
                reply = await post(session, gw.url, chat(stream=True))
                durations.append(time.monotonic() - started)
                assert reply.status == 200, reply.body

            for _ in range(5):  # 5 waves of 8 concurrent requests
                await asyncio.gather(*(one() for _ in range(8)))
            proxy.slow = False
        durations.sort()
        p99 = durations[int(0.99 * (len(durations) - 1))]
        assert p99 < DELAY_S, f"p99 {p99:.2f}s: a request waited for a slow Redis"
        await wait_released(gw, timeout_s=15)
