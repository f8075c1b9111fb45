"""The least a Python reverse proxy does: the baseline for what kvgate's own work costs.

Forwards every request (method, path, body, Content-Type) to one upstream over a pooled
keep-alive aiohttp session and streams the answer back as it arrives — nothing else: no
parsing, no tokens, no admission, no metrics, no access log. It runs on the same stack as
`kvgate serve` (aiohttp server and client, uvloop), so kvgate minus this is kvgate's work.

    .venv/bin/python bench/passthrough.py --upstream http://127.0.0.1:8001 --port 8002
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
FORWARDED = ("Content-Type", "Content-Length", "Cache-Control")


def build_app(upstream: str) -> web.Application:
    app = web.Application()

    async def session(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as http:
            app[SESSION] = http
            yield

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with request.app[SESSION].request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as answer:
            response = web.StreamResponse(
                status=answer.status,
                headers={h: answer.headers[h] for h in FORWARDED if h in answer.headers},
            )
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    with contextlib.suppress(ImportError):  # the same event loop kvgate serve runs on
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    app = build_app(args.upstream.rstrip("/"))
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
