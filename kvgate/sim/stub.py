"""A vLLM stand-in that answers at once from canned bodies, for tests and the overhead benchmark.

Unlike the simulator (`kvgate.sim.server`) it has no engine, no scheduler and no per-request
state: each event it writes is rendered once and then reused, so its own cost per request is
as small and as constant as an aiohttp server allows — any difference between the paths of
`bench/proxy_overhead.py` is the proxy's. It answers just what kvgate's discovery and request
path need:

    GET  /health                                200
    GET  /v1/models                             one model, with max_model_len
    GET  /metrics                               vllm:cache_config_info (and, with
                                                `load_gauges`, waiting 0 and KV usage 0.25)
    POST /v1/chat/completions, /v1/completions  `chunks` tokens (at most max_tokens), whole or
                                                streamed one write per event, like vLLM; a
                                                usage event when stream_options.include_usage

Tests script it: hold a stream open (`gate`), delay the headers, stall or cut a stream, answer
an error status or bytes that are not JSON, and read what arrived (`received`,
`headers_seen`) and how streams ended (`finished`, `cancelled`). A body field
`stub_token_interval_ms` paces a stream's tokens (a benchmark's pacing: the field passes
through every proxy untouched).

    python -m kvgate.sim.stub --port 8001 [--host 127.0.0.1]    the benchmark's replica
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"
# Canned events kept at most (a fuzzed model name renders new ones).
MAX_CANNED = 4096


@dataclass
class StubUpstream:
    model: str = "stub-model"
    num_gpu_blocks: int = 1000
    block_size: int = 16
    max_model_len: int = 4096
    chunks: int | None = 3  # tokens an answer writes, at most max_tokens; None: max_tokens
    prompt_tokens: int | None = 10  # what usage reports; None: a quarter of the body's bytes
    record: bool = True  # keep every body and its headers (`received`, `headers_seen`)
    load_gauges: bool = True  # /metrics shows vLLM's waiting and KV-usage gauges too
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
    # a stream ends on `data: [DONE]` with no blank line after it (an event left unterminated)
    unterminated_end: bool = False
    received: list[dict[str, Any]] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0
    finished: int = 0
    scrapes: int = 0  # GET /metrics answered
    url: str = ""
    runner: web.AppRunner | None = None
    _canned: dict[tuple[Any, ...], bytes] = field(default_factory=dict, repr=False)

    def app(self) -> web.Application:
        middlewares = [self._cookies] if self.set_cookie is not None else []
        # vLLM takes large bodies too
        app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
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
        )
        if self.load_gauges:
            text += (
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

    def _canned_event(self, key: tuple[Any, ...], render: Any) -> bytes:
        """`render()`'s bytes, rendered once per key."""
        event = self._canned.get(key)
        if event is None:
            if len(self._canned) >= MAX_CANNED:
                self._canned.clear()
            event = self._canned[key] = render()
        return event

    def _whole(self, chat: bool, model: str, n: int, prompt_tokens: int) -> bytes:
        def render() -> bytes:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": "tok " * n}
            else:
                choice["text"] = "tok " * n
            return orjson.dumps({
                "id": "x", "object": "chat.completion" if chat else "text_completion",
                "model": model, "choices": [choice], "usage": _usage(prompt_tokens, n)})

        return self._canned_event(("whole", chat, model, n, prompt_tokens), render)

    def _token(self, chat: bool, model: str, i: int) -> bytes:
        def render() -> bytes:
            if chat:
                chunk = {"id": "x", "object": "chat.completion.chunk", "model": model,
                         "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                      "finish_reason": None}]}
            else:
                chunk = {"id": "x", "object": "text_completion", "model": model,
                         "choices": [{"index": 0, "text": f"tok{i} ", "finish_reason": None}]}
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        return self._canned_event(("token", chat, model, i), render)

    def _usage_event(self, prompt_tokens: int, n: int) -> bytes:
        def render() -> bytes:
            usage = {"id": "x", "object": "chat.completion.chunk", "choices": [],
                     "usage": _usage(prompt_tokens, n)}
            return b"data: " + orjson.dumps(usage) + b"\n\n"

        return self._canned_event(("usage", prompt_tokens, n), render)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if self.record:
            body = json.loads(raw)  # as the replica reads it: integers beyond 64 bits too
            self.received.append(body)
            self.headers_seen.append({k.lower(): v for k, v in request.headers.items()})
        else:
            body = orjson.loads(raw)
        if self.delay_headers_s:
            await asyncio.sleep(self.delay_headers_s)
        if self.status != 200:
            return web.Response(status=self.status, body=self.error_body,
                                content_type="application/json")
        chat = request.path.endswith("chat/completions")
        limit = body.get("max_tokens") or None
        n = (limit or 16) if self.chunks is None else min(self.chunks, limit or self.chunks)
        prompt_tokens = len(raw) // 4 if self.prompt_tokens is None else self.prompt_tokens
        model = body["model"]
        if not body.get("stream"):
            self.finished += 1
            if self.raw_body is not None:
                return web.Response(body=self.raw_body, content_type="application/json")
            return web.Response(body=self._whole(chat, model, n, prompt_tokens),
                                content_type="application/json")
        return await self._stream(request, body, chat, model, n, prompt_tokens)

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, model: str, n: int,
        prompt_tokens: int,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        held: list[bytes] = []
        interval_s = float(body.get("stub_token_interval_ms") or 0) / 1000

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
                if i and interval_s:
                    await asyncio.sleep(interval_s)
                await send(self._token(chat, model, i))
                if i == 0 and self.gate is not None:
                    await self.gate.wait()
                if i == 0 and self.idle_after_first_chunk_s:
                    await asyncio.sleep(self.idle_after_first_chunk_s)
            if (body.get("stream_options") or {}).get("include_usage"):
                await send(self._usage_event(prompt_tokens, n))
            await send(DONE.rstrip(b"\n") if self.unterminated_end else DONE)
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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def benchmark_stub() -> StubUpstream:
    """The overhead benchmark's replica: `sim-model`, room for any load and a context of 256k
    tokens (its usage counts a quarter of the body's bytes, which kvgate's calibration then
    learns: a 100k-token prompt of cl100k reads as 160k), max_tokens tokens per answer,
    nothing recorded."""
    return StubUpstream(
        model="sim-model", num_gpu_blocks=1_000_000, max_model_len=262_144, chunks=None,
        prompt_tokens=None,
        record=False, load_gauges=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    with contextlib.suppress(ImportError):  # the same event loop kvgate serve runs on
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(benchmark_stub().app(), host=args.host, port=args.port, access_log=None,
                print=None)


if __name__ == "__main__":
    main()
