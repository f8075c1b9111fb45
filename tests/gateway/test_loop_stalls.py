"""The event loop never stalls on one request: huge bodies of tiny messages are refused by
count, and read in a worker process (`kvgate.request.front`).

Measured as the CPU time the loop's own thread spends on the requests, against the CPU time of
parsing the same bodies on it, in the same run: CPU time of one thread is what another process
on a busy machine cannot inflate, where a wall-clock bound on the loop's lateness flaked
(0.38 s against a bound of 0.3 s on a loaded CI machine, 2026-12-03)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson

from kvgate.errors import KvgateError
from kvgate.request.parsed import Endpoint, parse_body
from tests.plugins.gateway import RunningGateway, StubUpstream, gateway_config, openai_error

# Off the loop, what remains on its thread (reading the bodies, handing them over, taking back
# 4,000 messages) cost 0.06-0.07 s of CPU against 0.27-0.38 s for parsing them on it.
MAX_SHARE = 0.5
# A hang guard, not a timing claim: the loop waiting on the workers (a lock, a pool started on
# its thread) would show here, where it costs no CPU.
MAX_LAG_S = 2.0


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
    bodies = ((tiny, 400), (many, 200), (tiny, 400), (many, 200))

    async def send_all(http: aiohttp.ClientSession) -> None:
        for body, expected in bodies:
            async with http.post(f"{gw.url}/v1/chat/completions", data=body) as r:
                assert r.status == expected, await r.read()
                if expected == 400:
                    assert openai_error(await r.read())["code"] == "too_many_messages"

    stop, lags = asyncio.Event(), []  # type: ignore[var-annotated]
    watcher = asyncio.create_task(probe(stop, lags))
    try:
        async with aiohttp.ClientSession() as http:
            await send_all(http)  # the workers start on first use
            costs = []
            for _ in range(2):  # the least of two: noise only ever adds
                before = time.thread_time()
                await send_all(http)
                costs.append(time.thread_time() - before)
            on_loop = min(costs)
    finally:
        stop.set()
        await watcher
    costs = []
    for _ in range(2):
        before = time.thread_time()
        for body, _ in bodies:
            with contextlib.suppress(KvgateError):
                parse_body(body, Endpoint.CHAT)
        costs.append(time.thread_time() - before)
    inline = min(costs)
    assert on_loop < MAX_SHARE * inline, (on_loop, inline)
    assert max(lags) < MAX_LAG_S, f"the loop stalled {max(lags):.3f}s"
