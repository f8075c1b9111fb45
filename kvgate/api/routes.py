"""The HTTP surface: OpenAI endpoints, health, readiness, metrics and the admin view; and the
one middleware that turns every error into OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvgate.errors import KvgateError, MethodNotAllowed, NotFound, PayloadTooLarge, ServerError
from kvgate.gateway import REQUEST_INFO, Gateway, RequestInfo, new_request_info
from kvgate.requests import Endpoint

log = logging.getLogger(__name__)
access_log = logging.getLogger("kvgate.access")  # one JSON line per request, when enabled

GATEWAY = web.AppKey("gateway", Gateway)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: KvgateError, request_id: str | None = None) -> web.Response:
    headers = dict(error.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    return web.Response(
        body=orjson.dumps(error.body()), status=error.status, headers=headers,
        content_type="application/json",
    )


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves here as OpenAI's error body; client mistakes never as a 500. Every
    API request is counted (and, with server.access_log, logged) here once, by outcome."""
    info = new_request_info(request)
    request[REQUEST_INFO] = info
    gateway = request.app[GATEWAY]
    try:
        response = await handler(request)
    except asyncio.CancelledError:  # the client went away; everything held was released
        # a client that hangs up once it has [DONE] got its answer: that is not a disconnect
        _record(gateway, info, "ok" if info.delivered else "disconnected", 499)
        raise
    except KvgateError as exc:
        _record(gateway, info, "refused" if exc.status < 500 else "upstream_error", exc.status)
        gateway.metrics.refusals.labels(info.pool, info.tenant, exc.refusal_reason).inc()
        return error_response(exc, info.request_id)
    except web.HTTPException as exc:
        error = _from_http(exc)
        if error is None:
            raise
        return error_response(error, info.request_id)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        error = ServerError("kvgate failed to handle this request; see its logs")
        _record(gateway, info, "upstream_error", error.status)
        gateway.metrics.refusals.labels(info.pool, info.tenant, error.refusal_reason).inc()
        return error_response(error, info.request_id)
    if request.path.startswith("/v1/") and request.method == "POST":
        outcome = "ok" if response.status < 400 else "upstream_error"
        if 400 <= response.status < 500:
            outcome = "client_error"
        if info.disconnected:
            outcome = "disconnected"
        _record(gateway, info, outcome, response.status)
    return response


def _record(gateway: Gateway, info: RequestInfo, outcome: str, status: int) -> None:
    duration = time.monotonic() - info.started
    gateway.metrics.requests.labels(info.model, info.pool, info.tenant, outcome).inc()
    if outcome in ("ok", "disconnected", "client_error"):
        gateway.metrics.duration.labels(info.pool, info.model).observe(duration)
    if gateway.runtime.config.server.access_log:
        access_log.info("%s", orjson.dumps({
            "request_id": info.request_id, "tenant": info.tenant, "model": info.model,
            "pool": info.pool, "replica": info.replica, "status": status, "outcome": outcome,
            "prompt_tokens": info.prompt_tokens, "reserved_blocks": info.reserved_blocks,
            "charged_tokens": info.charged_tokens, "duration_s": round(duration, 4),
        }).decode())


def _from_http(exc: web.HTTPException) -> KvgateError | None:
    if exc.status == 404:
        return NotFound("no such endpoint", code="unknown_url")
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        return MethodNotAllowed(
            f"method not allowed here; use {allowed}" if allowed else "method not allowed",
            headers={"Allow": allowed} if allowed else None,
        )
    if exc.status == 413:
        return PayloadTooLarge("request body is too large")
    return None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[GATEWAY].handle(request, Endpoint.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await request.app[GATEWAY].handle(request, Endpoint.COMPLETIONS)


async def models(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    data = [
        {"id": name, "object": "model", "owned_by": "kvgate", "max_model_len": length}
        for name, length in sorted(gateway.registry.models().items())
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when every configured model (or, with none configured, any model) has at least
    one healthy replica."""
    gateway = request.app[GATEWAY]
    served = gateway.registry.models()
    wanted = [m.name for m in gateway.runtime.config.models]
    missing = [m for m in wanted if m not in served]
    ok = not missing if wanted else bool(served)
    body = {"ready": ok, "models": sorted(served), "missing": missing}
    return web.json_response(body, status=200 if ok else 503)


async def admin_prompts(request: web.Request) -> web.Response:
    """The live prefix fingerprints (tools + system prompt) with their request shares."""
    gateway = request.app[GATEWAY]
    return web.json_response(gateway.prompts.snapshot(gateway.runtime.config))


async def metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    return web.Response(
        body=gateway.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def admin_replicas(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    config = gateway.runtime.config.admission
    out = []
    for replica in gateway.registry:
        scrape = replica.scrape
        total = replica.num_gpu_blocks
        out.append({
            "id": replica.id,
            "url": replica.url,
            "pool": replica.pool,
            "healthy": replica.healthy,
            "last_error": replica.last_error,
            "models": sorted(replica.models),
            "num_gpu_blocks": total,
            "block_size": replica.block_size,
            "admissible_blocks": int(total * config.target_utilization) if total else None,
            "reserved_blocks": gateway.admission.reserved.get(replica.id, 0),
            "written_blocks": replica.written_blocks(),
            "inflight": len(replica.inflight),
            "shared_prefix_blocks": gateway.admission.prefixes.held_blocks(replica.id),
            "vllm": None if scrape is None else {
                "kv_usage": scrape.kv_usage, "running": scrape.running,
                "waiting": scrape.waiting, "preemptions": scrape.preemptions,
                "prefix_cache_hit_rate": (
                    scrape.prefix_hits / scrape.prefix_queries
                    if scrape.prefix_queries and scrape.prefix_hits is not None else None
                ),
                "age_s": round(time.monotonic() - scrape.at, 3),
            },
        })
    return web.json_response({"replicas": out})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/admin/prompts", admin_prompts)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/replicas", admin_replicas)
