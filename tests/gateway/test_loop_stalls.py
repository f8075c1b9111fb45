"""The event loop never stalls on one request: huge bodies of tiny messages are refused by
count, and read in a worker process (`kvgate.request.front`); a probe measures the loop's lateness
meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson

from tests.plugins.gateway import RunningGateway, StubUpstream, gateway_config, openai_error

# Generous: one of these bodies blocked the loop ~0.5 s when parsed and checked on it. What
# remains on the loop's thread is taking back 4,000 messages from the worker (~15 ms).
MAX_LAG_S = 0.3


async def probe(stop: asyncio.Event, lags: list[float], period_s: float = 0.01) -> None:
    """Sleeps `period_s` again and again; records how late each wake-up came."""
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(period_s)
        lags.append(time.perf_counter() - before - period_s)


async def test_huge_bodies_of_tiny_messages_never_stall_the_loop(
    stub_factory: Callable[..., Awaitable[StubUpstream]],
    gateway_factory: Callable[..., Awaitable[RunningGateway]],
) -> None:
    stub = await stub_factory(max_model_len=200_000, num_gpu_blocks=100_000)
    gw = await gateway_factory(gateway_config([stub.url]))
    tiny = orjson.dumps({"model": "stub-model", "max_tokens": 5,
                         "messages": [{"role": "user", "content": "x"}] * 240_000})
    assert len(tiny) < 8 * 1024 * 1024  # under the default body limit
    many = orjson.dumps({"model": "stub-model", "max_tokens": 5,
                         "messages": [{"role": "user", "content": f"m{i}"} for i in range(4000)]})
    stop, lags = asyncio.Event(), []  # type: ignore[var-annotated]
    watcher = asyncio.create_task(probe(stop, lags))
    try:
        async with aiohttp.ClientSession() as http:
            for body, expected in ((tiny, 400), (many, 200), (tiny, 400), (many, 200)):
                async with http.post(f"{gw.url}/v1/chat/completions", data=body) as r:
                    assert r.status == expected, await r.read()
                    if expected == 400:
                        assert openai_error(await r.read())["code"] == "too_many_messages"
    finally:
        stop.set()
        await watcher
    assert max(lags) < MAX_LAG_S, f"the loop stalled {max(lags):.3f}s"
