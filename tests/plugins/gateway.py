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

from kvgate.app import build_app
from kvgate.config import Config, parse_config
from kvgate.gateway import Gateway
from kvgate.api.routes import GATEWAY
from kvgate.state.base import StateStore


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
    received: list[dict[str, Any]] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0
    finished: int = 0
    url: str = ""
    runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
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
        try:
            for i in range(n):
                delta = {"content": f"tok{i} "}
                if chat:
                    chunk = {"id": "x", "object": "chat.completion.chunk", "model": body["model"],
                             "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                else:
                    chunk = {"id": "x", "object": "text_completion", "model": body["model"],
                             "choices": [{"index": 0, "text": f"tok{i} ", "finish_reason": None}]}
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if i == 0 and self.gate is not None:
                    await self.gate.wait()
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"id": "x", "object": "chat.completion.chunk", "choices": [],
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                   "total_tokens": prompt_tokens + n}}
                await response.write(b"data: " + orjson.dumps(usage) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
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
