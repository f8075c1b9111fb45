"""bench/proxy_overhead.py counts a request only if its answer is whole: its check must accept
what the benchmark's replica (kvgate.sim.stub) answers, or every contender measures 0 req/s."""

from __future__ import annotations

import aiohttp
import proxy_overhead  # bench/proxy_overhead.py
import pytest

from kvgate.sim.stub import benchmark_stub
from tests.plugins.gateway import serve_app


@pytest.mark.parametrize("workload", [proxy_overhead.NON_STREAMED, proxy_overhead.STREAMED,
                                      proxy_overhead.PACED], ids=lambda w: w.name)  # fmt: skip
async def test_the_stubs_answer_to_each_workload_is_counted_whole(workload):
    runner, url = await serve_app(benchmark_stub().app())
    try:
        async with aiohttp.ClientSession() as http, http.post(
            f"{url}/v1/chat/completions", json=workload.body(0)
        ) as r:
            raw = await r.read()
        assert r.status == 200, raw
        assert workload.complete(raw), raw[:300]
        assert not workload.complete(raw[: len(raw) // 2])
    finally:
        await runner.cleanup()
