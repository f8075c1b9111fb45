"""Fixtures for gateway tests: a scriptable stub upstream and a kvgate on a real socket.

The stub (`kvgate.sim.stub.StubUpstream`, the overhead benchmark's replica too) speaks just
enough of vLLM's API (health, models, metrics with cache_config_info, chat/completions
streaming and not) and lets a test hold a stream open, see what arrived, and see the upstream
request get cancelled. Behavioural tests of KV pressure use the simulator.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiohttp import web

from kvgate.api.routes import GATEWAY
from kvgate.app import STORE, build_app
from kvgate.config import Config, parse_config
from kvgate.gateway import Gateway
from kvgate.sim.stub import StubUpstream
from kvgate.state.base import StateStore
from kvgate.tenants import tenant_key


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def stub_factory() -> AsyncIterator[Callable[..., Awaitable[StubUpstream]]]:
    stubs: list[StubUpstream] = []

    async def make(**kwargs: Any) -> StubUpstream:
        stub = StubUpstream(**kwargs)
        stub.runner, stub.url = await serve_app(stub.app())
        stubs.append(stub)
        return stub

    yield make
    for stub in stubs:
        if stub.gate is not None:
            stub.gate.set()
        assert stub.runner is not None
        await stub.runner.cleanup()


@dataclass
class RunningGateway:
    url: str
    app: web.Application
    runner: web.AppRunner

    @property
    def gateway(self) -> Gateway:
        return self.app[GATEWAY]

    @property
    def store(self) -> StateStore:
        return self.app[STORE]

    async def wait_healthy(self, count: int | None = None, timeout_s: float = 10.0) -> None:
        """Until discovery has seen `count` (default: all) replicas healthy with capacity."""
        deadline = time.monotonic() + timeout_s
        registry = self.gateway.registry
        want = len(registry) if count is None else count
        while sum(1 for r in registry if r.healthy and r.num_gpu_blocks) < want:
            if time.monotonic() > deadline:
                states = [(r.id, r.healthy, r.last_error) for r in registry]
                raise AssertionError(f"replicas not healthy in time: {states}")
            await asyncio.sleep(0.02)


def gateway_config(replicas: list[str], **sections: Any) -> Config:
    tree: dict[str, Any] = {
        "pools": {"default": {"replicas": [{"url": u} for u in replicas]}},
        "discovery": {"interval_s": 0.1, "timeout_s": 1.0},
        "timeouts": {"connect_s": 2, "first_byte_s": 10, "idle_s": 10, "total_s": 30},
    }
    tree.update(sections)
    return parse_config(tree)


@pytest.fixture
async def gateway_factory() -> AsyncIterator[Callable[..., Awaitable[RunningGateway]]]:
    running: list[RunningGateway] = []

    async def make(
        config: Config, store: StateStore | None = None, wait: bool = True, **options: Any
    ) -> RunningGateway:
        """`options`: more of build_app's arguments (a test's clock and sleep)."""
        app = build_app(config, store=store, **options)
        runner, url = await serve_app(app)
        gw = RunningGateway(url, app, runner)
        running.append(gw)
        if wait:
            await gw.wait_healthy()
        return gw

    yield make
    for gw in running:
        await gw.runner.cleanup()


def openai_error(raw: bytes) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped error body, after checking the shape exactly."""
    data = orjson.loads(raw)
    assert isinstance(data, dict) and set(data) == {"error"}, data
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error  # type: ignore[no-any-return]


async def wait_settled(gw: RunningGateway, timeout_s: float = 5.0) -> None:
    """Until every replica's ledger is back to 0, nothing is in flight, this instance holds
    no lease and no shared prefix, and every request's tenant charge is closed (settled, or
    refunded): a whole answer the client gave up on is charged after its slot is released,
    once the replica's /metrics covers its end; else fail."""
    deadline = time.monotonic() + timeout_s
    admission = gw.gateway.admission
    while True:
        held = {r.id: await gw.store.held(f"ledger:{r.id}") for r in gw.gateway.registry}
        inflight = {r.id: list(r.inflight) for r in gw.gateway.registry if r.inflight}
        leases = admission.keeper.live_leases()
        charging = open_charges(gw)
        if (not any(held.values()) and not inflight and not leases
                and not len(admission.prefixes) and not charging):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not settled: ledgers {held}, in flight {inflight}, {leases} leases kept, "
                f"{len(admission.prefixes)} shared prefixes, charges open {charging}"
            )
        await asyncio.sleep(0.01)


def open_charges(gw: RunningGateway) -> dict[str, float]:
    """Tenants with a request whose charge is not closed yet (its gauge of requests in
    progress), by count."""
    samples = (s for m in gw.gateway.metrics.tenant_concurrency.collect() for s in m.samples)
    return {s.labels["tenant"]: s.value for s in samples if s.value}


async def wait_released(gw: RunningGateway, timeout_s: float = 10.0) -> None:
    """`wait_settled`, and also: every pool's queue empty and every tenant's concurrency count
    zero in the state store. What a fault test asserts once its load is over."""
    await wait_settled(gw, timeout_s)
    deadline = time.monotonic() + timeout_s
    gateway = gw.gateway
    tenants = {t.name for t in gateway.runtime.config.tenants} | {"anonymous"}
    while True:
        # the queue's length has no public reader; the gauge lags by up to a second
        queued = {p: len(gateway.admission.pool(p).queue) for p in gateway.admission.pools()}
        running = {t: await gw.store.held(tenant_key(t, "concurrency")) for t in sorted(tenants)}
        if not any(queued.values()) and not any(running.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not released: queued {queued}, tenant concurrency {running}")
        await asyncio.sleep(0.01)
