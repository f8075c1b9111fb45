"""Replica faults under concurrent streaming load, each ending with every ledger, tenant
concurrency count, queue and lease back to zero and no client left hanging.

Killed mid-stream, 500s with the circuit, and drain are in test_routing_sim.py (which ends
with the same `wait_released`); here: a replica that accepts and never answers, one that
answers 500 to a fraction of requests, and one that flaps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvgate.app import reload
from kvgate.sim.faults import Faults
from kvgate.sim.server import SimReplica
from tests.plugins.gateway import RunningGateway, gateway_config, wait_released

SIM = dict(num_gpu_blocks=512, max_model_len=4096, time_scale=0.02, output_len_dist="max")
HANG_GUARD_S = 15.0  # far above any answer kvgate should give, far below the test timeout
CLIENTS = 8
TENANT = {"name": "team", "max_concurrent": 100}
SimFactory = Callable[..., Awaitable[SimReplica]]
GatewayFactory = Callable[..., Awaitable[RunningGateway]]


async def fleet(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, **sections: Any
) -> tuple[list[SimReplica], RunningGateway]:
    sims = [await sim_factory(**SIM, seed=i) for i in range(2)]
    tree: dict[str, Any] = {
        "pools": {"default": {"replicas": [{"url": s.url, "name": f"r{i}"}
                                           for i, s in enumerate(sims)]}},
        "auth": {"mode": "none", "anonymous_tenant": "team"}, "tenants": [TENANT],
        "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 2, "total_s": 10},
        **sections,
    }
    return sims, await gateway_factory(gateway_config([], **tree))


async def clients(gw: RunningGateway, rounds: int, seed: int = 2) -> Counter[str]:
    """CLIENTS concurrent streaming clients, `rounds` requests each; one in four hangs up
    after its first chunk. Returns how the requests ended; a hang fails the test."""
    rng = random.Random(seed)
    ends: Counter[str] = Counter()

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "sim-model", "max_tokens": 24, "stream": True,
                "messages": [{"role": "user", "content": f"client {i}: tell me a story"}]}
        hang_up = rng.random() < 0.25
        async with asyncio.timeout(HANG_GUARD_S), http.post(
            f"{gw.url}/v1/chat/completions", json=body
        ) as resp:
            if resp.status != 200:
                ends[f"status {resp.status}"] += 1
                await resp.read()
                return
            received = b""
            async for chunk in resp.content.iter_any():
                received += chunk
                if hang_up:
                    ends["hung up"] += 1
                    return
        ends["done" if received.endswith(b"data: [DONE]\n\n") else "cut"] += 1

    async def client(http: aiohttp.ClientSession, c: int) -> None:
        for r in range(rounds):
            await one(http, c * rounds + r)

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(http, c) for c in range(CLIENTS)))
    return ends


async def test_a_replica_that_accepts_and_never_answers_costs_timeouts_not_leaks(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    sims, gw = await fleet(sim_factory, gateway_factory,
                           routing={"retry": {"attempts": 1, "on_timeout": True}})
    sims[0].faults = Faults(hang=True)
    ends = await clients(gw, rounds=3)
    assert sum(ends.values()) == CLIENTS * 3
    assert set(ends) <= {"done", "hung up", "status 504", "status 503"}, ends
    assert ends["done"] > 0
    await wait_released(gw)
    sims[0].faults = Faults()  # the hung requests on the replica end too


@pytest.mark.parametrize("fraction", [0.3, 1.0])
async def test_a_replica_answering_500_to_a_fraction_of_requests_leaves_nothing_held(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, fraction: float
) -> None:
    sims, gw = await fleet(sim_factory, gateway_factory)
    sims[0].faults = Faults(error_rate=fraction)
    ends = await clients(gw, rounds=4)
    assert sum(ends.values()) == CLIENTS * 4
    assert set(ends) <= {"done", "hung up", "status 502", "status 503"}, ends
    assert ends["done"] >= CLIENTS  # retried elsewhere before the first byte, mostly
    await wait_released(gw)


async def test_a_flapping_replica_leaves_nothing_held(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    sims, gw = await fleet(sim_factory, gateway_factory)
    stop = asyncio.Event()

    async def flap() -> None:
        while not stop.is_set():
            await sims[0].set_faults(dataclasses.replace(sims[0].faults, stopped=True))
            await asyncio.sleep(0.15)
            await sims[0].set_faults(dataclasses.replace(sims[0].faults, stopped=False))
            await asyncio.sleep(0.15)

    flapping = asyncio.create_task(flap())
    try:
        ends = await clients(gw, rounds=5)
    finally:
        stop.set()
        await flapping
    assert sum(ends.values()) == CLIENTS * 5
    assert set(ends) <= {"done", "hung up", "cut", "status 502", "status 503"}, ends
    assert ends["done"] > 0
    await wait_released(gw)


async def test_config_reloads_under_load_leave_nothing_held(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    _, gw = await fleet(sim_factory, gateway_factory)
    base = gw.gateway.runtime.config
    variants = [
        base.model_copy(update={"tenants": [base.tenants[0].model_copy(
            update={"max_concurrent": limit})]}) for limit in (100, 60, 100)
    ]
    stop = asyncio.Event()
    reloads = 0

    async def reload_often() -> None:
        nonlocal reloads
        while not stop.is_set():
            variant = variants[reloads % len(variants)]
            assert await reload(gw.app, lambda variant=variant: variant)
            reloads += 1
            await asyncio.sleep(0.01)

    reloading = asyncio.create_task(reload_often())
    try:
        ends = await clients(gw, rounds=4)
    finally:
        stop.set()
        await reloading
    assert reloads >= 3
    assert sum(ends.values()) == CLIENTS * 4 and set(ends) <= {"done", "hung up"}, ends
    await wait_released(gw)
