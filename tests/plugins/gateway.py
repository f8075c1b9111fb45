"""Fixtures for gateway tests: a scriptable stub upstream and a kvgate on a real socket.

The stub speaks just enough of vLLM's API (health, models, metrics with cache_config_info,
chat/completions streaming and not) and lets a test hold a stream open, see what arrived, and
see the upstream request get cancelled. Behavioural tests of KV pressure use the simulator.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from kvgate.api.routes import GATEWAY
from kvgate.app import build_app
from kvgate.config import Config, parse_config
from kvgate.gateway import Gateway
from kvgate.state.base import StateStore
from kvgate.tenants import tenant_key


@dataclass
class StubUpstream:
    model: str = "stub-model"
    num_gpu_blocks: int = 1000
    block_size: int = 16
    max_model_len: int = 4096
    chunks: int = 3
    status: int = 200
    error_body: bytes = b'{"error": {"message": "boom", "type": "InternalError", "param": null, "code": 500}}'
    gate: asyncio.Event | None = None  # streams wait here after the first chunk
    delay_headers_s: float = 0.0
    # Mid-stream failures: stall this long after the first chunk, or cut the connection
    # (no terminating chunk) once this many chunks are out.
    idle_after_first_chunk_s: float = 0.0
    drop_after_chunks: int | None = None
    # Answer a non-streamed call 200 with exactly these bytes (e.g. invalid JSON).
    raw_body: bytes | None = None
    set_cookie: str | None = None  # a Set-Cookie header on every answer
    one_write: bool = False  # a stream's events all in one write (the proxy reads them at once)
    received: list[dict[str, Any]] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0
    finished: int = 0
    scrapes: int = 0  # GET /metrics answered
    url: str = ""
    runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._cookies])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "vllm",
             "max_model_len": self.max_model_len}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        text = (
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",'
            f'num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="{self.model}"}} 0.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{self.model}"}} 0.25\n'
        )
        return web.Response(text=text)

    @web.middleware
    async def _cookies(self, request: web.Request, handler: Any) -> web.StreamResponse:
        response: web.StreamResponse = await handler(request)
        if self.set_cookie is not None and not response.prepared:
            response.headers["Set-Cookie"] = self.set_cookie
        return response

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers_seen.append({k.lower(): v for k, v in request.headers.items()})
        if self.delay_headers_s:
            await asyncio.sleep(self.delay_headers_s)
        if self.status != 200:
            return web.Response(status=self.status, body=self.error_body,
                                content_type="application/json")
        chat = request.path.endswith("chat/completions")
        n = min(self.chunks, body.get("max_tokens") or self.chunks)
        prompt_tokens = 10
        if not body.get("stream"):
            self.finished += 1
            if self.raw_body is not None:
                return web.Response(body=self.raw_body, content_type="application/json")
            message = {"role": "assistant", "content": "tok " * n}
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": message} if chat else {"text": "tok " * n})
            return web.json_response({
                "id": "x", "object": "chat.completion" if chat else "text_completion",
                "model": body["model"], "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                          "total_tokens": prompt_tokens + n}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        held: list[bytes] = []

        async def send(data: bytes) -> None:
            if self.one_write:
                held.append(data)
            else:
                await response.write(data)

        try:
            for i in range(n):
                if self.drop_after_chunks is not None and i >= self.drop_after_chunks:
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                delta = {"content": f"tok{i} "}
                if chat:
                    chunk = {"id": "x", "object": "chat.completion.chunk", "model": body["model"],
                             "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                else:
                    chunk = {"id": "x", "object": "text_completion", "model": body["model"],
                             "choices": [{"index": 0, "text": f"tok{i} ", "finish_reason": None}]}
                await send(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if i == 0 and self.gate is not None:
                    await self.gate.wait()
                if i == 0 and self.idle_after_first_chunk_s:
                    await asyncio.sleep(self.idle_after_first_chunk_s)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"id": "x", "object": "chat.completion.chunk", "choices": [],
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                   "total_tokens": prompt_tokens + n}}
                await send(b"data: " + orjson.dumps(usage) + b"\n\n")
            await send(b"data: [DONE]\n\n")
            if held:
                await response.write(b"".join(held))
            await response.write_eof()
            self.finished += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except ConnectionResetError:
            self.cancelled += 1
        return response


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

    async def make(config: Config, store: StateStore | None = None, wait: bool = True) -> RunningGateway:
        app = build_app(config, store=store)
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
    """Until every replica's ledger is back to 0, nothing is in flight, and this instance
    holds no lease and no shared prefix; else fail."""
    deadline = time.monotonic() + timeout_s
    admission = gw.gateway.admission
    while True:
        held = {r.id: await gw.gateway.store.held(f"ledger:{r.id}") for r in gw.gateway.registry}
        inflight = {r.id: list(r.inflight) for r in gw.gateway.registry if r.inflight}
        leases = admission.keeper.live_leases()
        if not any(held.values()) and not inflight and not leases and not len(admission.prefixes):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not settled: ledgers {held}, in flight {inflight}, {leases} leases kept, "
                f"{len(admission.prefixes)} shared prefixes"
            )
        await asyncio.sleep(0.01)


async def wait_released(gw: RunningGateway, timeout_s: float = 10.0) -> None:
    """`wait_settled`, and also: every pool's queue empty and every tenant's concurrency count
    zero in the state store. What a fault test asserts once its load is over."""
    await wait_settled(gw, timeout_s)
    deadline = time.monotonic() + timeout_s
    gateway = gw.gateway
    tenants = {t.name for t in gateway.runtime.config.tenants} | {"anonymous"}
    while True:
        # the queue's length has no public reader; the gauge lags by up to a second
        queued = {p: len(gateway.admission._pool(p).queue) for p in gateway.admission.pools()}
        running = {t: await gateway.store.held(tenant_key(t, "concurrency")) for t in sorted(tenants)}
        if not any(queued.values()) and not any(running.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not released: queued {queued}, tenant concurrency {running}")
        await asyncio.sleep(0.01)
