"""kvgate in front of simulated vLLM replicas under KV pressure.

The same overload that makes a bare replica preempt (it admits on the prompt and runs out of
blocks while decoding) must, through kvgate, cause no preemption and no failure: kvgate holds
back what does not fit in its worst case, and lets it in as blocks free.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.plugins.bodies import SIM_MODEL, chat
from tests.plugins.gateway import gateway_config

# 256 blocks × 16 = 4,096 tokens of KV. Each request: ~60 prompt tokens + 300 generated
# (ignore_eos: the full length) = 23 blocks worst case; 24 at once need ~550 blocks > 256.
SIM = dict(num_gpu_blocks=256, max_model_len=2048, max_num_seqs=64, time_scale=0.02)
N_REQUESTS = 24


def body(i: int, stream: bool = False) -> dict:
    return chat(f"Request number {i}: tell me about KV caches.", model=SIM_MODEL,
                system_prompt="You are a concise assistant for load tests.", max_tokens=300,
                ignore_eos=True, stream=stream)


async def fire(url: str, n: int, stream: bool = False) -> list[tuple[int, float | None]]:
    """n concurrent requests; (status, seconds to first byte of the body) each."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def one(i: int) -> tuple[int, float | None]:
            start = time.monotonic()
            async with session.post(f"{url}/v1/chat/completions", json=body(i, stream)) as r:
                first = None
                async for _ in r.content.iter_any():
                    first = first or time.monotonic() - start
                return r.status, first

        return await asyncio.gather(*(one(i) for i in range(n)))


async def test_bare_replica_preempts_under_this_overload(sim_factory):
    replica = await sim_factory(**SIM)
    results = await fire(replica.url, N_REQUESTS)
    assert all(status == 200 for status, _ in results)
    assert replica.engine.stats.num_preemptions > 0


async def test_through_kvgate_the_same_overload_never_preempts_and_nothing_fails(
    sim_factory, gateway_factory
):
    replica = await sim_factory(**SIM)
    config = gateway_config([replica.url], admission={"queue": {"max_wait_s": 50}})
    gw = await gateway_factory(config)
    results = await fire(gw.url, N_REQUESTS, stream=True)
    assert [s for s, _ in results] == [200] * N_REQUESTS
    assert replica.engine.stats.num_preemptions == 0
    assert replica.engine.stats.finished == N_REQUESTS
    # Everything reserved was given back, and the queue is empty.
    (kv_replica,) = gw.gateway.registry
    assert await gw.store.held(f"ledger:{kv_replica.id}") == 0
    assert not kv_replica.inflight
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/metrics") as r:
        metrics = await r.text()
    assert 'kvgate_admissions_total{pool="default",queued="yes"' in metrics


async def test_three_times_overload_completes_or_is_refused_clearly(sim_factory, gateway_factory):
    """With a short queue wait, what cannot be served in time gets a 429 with Retry-After;
    nothing else fails, nothing preempts, and the ledger drains to zero."""
    replica = await sim_factory(**SIM)
    config = gateway_config(
        [replica.url], admission={"queue": {"max_wait_s": 0.3, "max_depth": 8}}
    )
    gw = await gateway_factory(config)
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> tuple[int, dict]:
            async with session.post(f"{gw.url}/v1/chat/completions", json=body(i)) as r:
                return r.status, {"retry": r.headers.get("Retry-After"), **(await r.json())}

        results = await asyncio.gather(*(one(i) for i in range(N_REQUESTS)))
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 9
    for status, data in results:
        if status == 429:
            assert data["error"]["code"] in ("queue_full", "queue_timeout")
            assert int(data["retry"]) >= 1
    assert replica.engine.stats.num_preemptions == 0
    (kv_replica,) = gw.gateway.registry
    assert await gw.store.held(f"ledger:{kv_replica.id}") == 0


async def test_short_requests_are_not_starved_by_long_ones_behind_a_long_pool(
    sim_factory, gateway_factory
):
    """Long documents go to the long pool, so short chats keep a low time to first token."""
    normal = await sim_factory(**SIM)
    long = await sim_factory(num_gpu_blocks=1024, max_model_len=8192, time_scale=0.02)
    config = gateway_config(
        [normal.url],
        pools={
            "default": {"replicas": [{"url": normal.url}]},
            "long": {"replicas": [{"url": long.url}], "min_worst_case_tokens": 2048},
        },
        admission={"queue": {"max_wait_s": 50}},
    )
    gw = await gateway_factory(config)
    document = "A long document about caches. " * 400  # ~2.8k tokens
    async with aiohttp.ClientSession() as session:

        async def ask(content: str, max_tokens: int) -> str:
            payload = {"model": "sim-model", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": content}]}
            async with session.post(f"{gw.url}/v1/chat/completions", json=payload) as r:
                assert r.status == 200, await r.text()
                return r.headers["X-Kvgate-Pool"]

        pools = await asyncio.gather(
            *(ask(document, 200) for _ in range(3)), *(ask(f"hi {i}", 20) for i in range(6))
        )
    assert pools[:3] == ["long"] * 3 and pools[3:] == ["default"] * 6
    assert normal.engine.stats.num_preemptions == 0


async def test_with_admission_disabled_the_same_overload_preempts_through_kvgate(
    sim_factory, gateway_factory
):
    """The control for the test above: it is the ledger that prevents preemption."""
    replica = await sim_factory(**SIM)
    gw = await gateway_factory(gateway_config([replica.url], admission={"enabled": False}))
    results = await fire(gw.url, N_REQUESTS, stream=True)
    assert [s for s, _ in results] == [200] * N_REQUESTS
    assert replica.engine.stats.num_preemptions > 0
