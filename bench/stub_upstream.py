"""A vLLM stand-in that answers at once, for measuring what a proxy in front of it costs.

Unlike `kvgate sim` it has no engine, no scheduler and no per-request state: every body is
pre-rendered at start, so the upstream's own cost is as small and as constant as an aiohttp
server allows, and any difference between the paths of `bench/proxy_overhead.py` is the
proxy's. It answers just what kvgate's discovery and request path need:

    GET  /health               200
    GET  /v1/models            one model (`sim-model`) with max_model_len
    GET  /metrics              vllm:cache_config_info (block_size 16, num_gpu_blocks 100000)
    POST /v1/chat/completions  max_tokens filler tokens, whole or streamed (one write per SSE
                               event, like vLLM); a usage chunk when
                               stream_options.include_usage is set

    .venv/bin/python bench/stub_upstream.py --port 8001 [--host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

MODEL = "sim-model"
MAX_MODEL_LEN = 4096
RESPONSE_ID = "chatcmpl-stub"
CREATED = 1_700_000_000
METRICS = (
    b"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    b"# TYPE vllm:cache_config_info gauge\n"
    b'vllm:cache_config_info{block_size="16",num_gpu_blocks="100000",engine="0"} 1.0\n'
)
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Bodies:
    """Every byte string the stub sends, rendered once."""

    models: bytes
    role: bytes
    token: bytes
    last_token: bytes

    @classmethod
    def render(cls) -> Bodies:
        head = (
            b'data: {"id":"' + RESPONSE_ID.encode() + b'","object":"chat.completion.chunk",'
            b'"created":' + str(CREATED).encode() + b',"model":"' + MODEL.encode()
            + b'","choices":[{"index":0,'
        )  # fmt: skip
        tail = b',"logprobs":null,"finish_reason":'
        models = {
            "object": "list",
            "data": [{"id": MODEL, "object": "model", "owned_by": "stub",
                      "max_model_len": MAX_MODEL_LEN}],
        }  # fmt: skip
        return cls(
            models=orjson.dumps(models),
            role=head + b'"delta":{"role":"assistant","content":""}' + tail + b"null}]}\n\n",
            token=head + b'"delta":{"content":"word "}' + tail + b"null}]}\n\n",
            last_token=head + b'"delta":{"content":"word "}' + tail + b'"length"}]}\n\n',
        )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def whole(max_tokens: int, prompt_tokens: int) -> bytes:
    return orjson.dumps({
        "id": RESPONSE_ID, "object": "chat.completion", "created": CREATED, "model": MODEL,
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "word " * max_tokens},
            "logprobs": None, "finish_reason": "length", "stop_reason": None,
        }],
        "usage": usage(prompt_tokens, max_tokens),
    })  # fmt: skip


def usage_event(prompt_tokens: int, completion_tokens: int) -> bytes:
    return b"data: " + orjson.dumps({
        "id": RESPONSE_ID, "object": "chat.completion.chunk", "created": CREATED,
        "model": MODEL, "choices": [], "usage": usage(prompt_tokens, completion_tokens),
    }) + b"\n\n"  # fmt: skip


def build_app() -> web.Application:
    bodies = Bodies.render()
    app = web.Application()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=bodies.models, content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=METRICS, content_type="text/plain")

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        data: dict[str, Any] = orjson.loads(raw)
        max_tokens = int(data.get("max_tokens") or 16)
        prompt_tokens = len(raw) // 4  # a stand-in; kvgate's calibration clamps the ratio
        if not data.get("stream"):
            return web.Response(
                body=whole(max_tokens, prompt_tokens), content_type="application/json"
            )
        response = web.StreamResponse(headers={"Cache-Control": "no-cache"})
        response.content_type = "text/event-stream"
        await response.prepare(request)
        # a benchmark's pacing (vLLM writes each token as it decodes it): the field passes
        # through every contender untouched
        interval_s = float(data.get("stub_token_interval_ms") or 0) / 1000
        await response.write(bodies.role)
        for _ in range(max_tokens - 1):
            if interval_s:
                await asyncio.sleep(interval_s)
            await response.write(bodies.token)
        await response.write(bodies.last_token)
        if (data.get("stream_options") or {}).get("include_usage"):
            await response.write(usage_event(prompt_tokens, max_tokens))
        await response.write(DONE)
        await response.write_eof()
        return response

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    with contextlib.suppress(ImportError):  # the same event loop kvgate serve runs on
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(build_app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
