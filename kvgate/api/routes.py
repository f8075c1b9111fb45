"""The HTTP surface: OpenAI endpoints, health, readiness, metrics and the admin view; and the
one middleware that turns every error into OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvgate.errors import KvgateError, MethodNotAllowed, NotFound, PayloadTooLarge, ServerError
from kvgate.exchange import EXCHANGE, Exchange
from kvgate.fleet.snapshot import BASES
from kvgate.gateway import Gateway
from kvgate.request.ending import CLIENT_LEFT, finish
from kvgate.request.parsed import Endpoint
from kvgate.workers import PEERS

log = logging.getLogger(__name__)

GATEWAY = web.AppKey("gateway", Gateway)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: KvgateError, request_id: str | None = None) -> web.Response:
    headers = dict(error.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    response = web.Response(
        body=orjson.dumps(error.body()), status=error.status, headers=headers,
        content_type="application/json",
    )
    if headers.get("Connection", "").lower() == "close":  # e.g. a body that never arrived whole
        response.force_close()
    return response


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves here as OpenAI's error body; client mistakes never as a 500. Every
    API request's ending is recorded here once (`kvgate.request.ending.finish`)."""
    gateway = request.app[GATEWAY]
    x = request[EXCHANGE] = Exchange.arriving(request.headers, gateway.runtime)

    def ended(status: int, error: BaseException | None = None) -> None:
        finish(gateway.metrics, x.rt.config, x, status, error)

    try:
        response = await handler(request)
    except asyncio.CancelledError as exc:  # the client went away; everything held was released
        ended(CLIENT_LEFT, exc)
        raise
    except KvgateError as exc:
        ended(exc.status, exc)
        return error_response(exc, x.request_id)
    except web.HTTPException as exc:
        error = _from_http(exc)
        if error is None:
            raise
        return error_response(error, x.request_id)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        error = ServerError("kvgate failed to handle this request; see its logs")
        ended(error.status, error)
        return error_response(error, x.request_id)
    if request.path.startswith("/v1/") and request.method == "POST":
        ended(response.status)
    return response


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
    return web.json_response(request.app[GATEWAY].registry.model_list())


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when every configured model (or, with none configured, any model) has at least
    one healthy replica."""
    gateway = request.app[GATEWAY]
    body = gateway.registry.readiness(m.name for m in gateway.runtime.config.models)
    return web.json_response(body, status=200 if body["ready"] else 503)


async def admin_prompts(request: web.Request) -> web.Response:
    """The live prefix fingerprints (tools + system prompt) with their request shares."""
    gateway = request.app[GATEWAY]
    return web.json_response(gateway.front.prompts.snapshot(gateway.runtime.config))


async def metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    body = gateway.metrics.render()
    peers = request.app.get(PEERS)  # one of `kvgate serve --workers N`: every worker's figures
    if peers is not None and "own" not in request.query:
        body = await peers.merged(body)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def admin_replicas(request: web.Request) -> web.Response:
    """The fleet as routing and admission see it (the same snapshot the gauges export)."""
    gateway = request.app[GATEWAY]
    out = []
    for view in gateway.view.take(gateway.runtime.config):
        replica = view.replica
        out.append({
            "id": view.id,
            "url": replica.url,
            "pool": view.pool,
            "healthy": view.healthy,
            "circuit": view.circuit,
            "busy": view.busy,  # its vLLM refused one of ours lately (queue limits)
            "draining": view.draining,
            "last_error": replica.last_error,
            "models": sorted(view.models),
            "num_gpu_blocks": view.num_gpu_blocks,
            "block_size": view.block_size,
            "admissible_blocks": view.admissible_blocks,
            "reserved_blocks": view.reserved_blocks,
            "written_blocks": view.written_blocks,
            # at predicted demand and at the worst case (kvgate_replica_headroom_requests)
            "headroom_blocks": {basis: view.headroom_blocks(basis) for basis in BASES},
            "headroom_requests": {basis: view.headroom_requests(basis) for basis in BASES},
            "overcommit": view.overcommit,
            "inflight": view.inflight,
            "shared_prefix_blocks": view.shared_prefix_blocks,
            # its KV cache events (None: its pool does not subscribe), and so what prefix
            # routing knows of its cache: the blocks it holds, or the prompt's fingerprint
            "kv_events": gateway.kv_events.describe(view.id),
            "prefix_source": (
                "kv_events" if gateway.kv_events.index(view.id) is not None else "fingerprint"
            ),
            "vllm": None if view.scrape_age_s is None else {
                "kv_usage": view.kv_usage, "running": view.running,
                "waiting": view.waiting, "preemptions": view.preemptions,
                "prefix_cache_hit_rate": view.prefix_hit_rate,
                "age_s": view.scrape_age_s,
            },
        })
    return web.json_response({"replicas": out})


def _drain_handler(drain: bool) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        """Drain a replica (no new requests; in-flight ones finish; its sessions are rebound
        on their next request) or take it back: here at once, on every instance sharing the
        state store within a discovery interval (`kvgate.fleet.drain`)."""
        gateway = request.app[GATEWAY]
        replica = gateway.registry.get(request.match_info["replica"])
        if replica is None:
            raise NotFound(f"no replica {request.match_info['replica']!r}", code="unknown_replica")
        await gateway.admission.drain(replica, drain)
        log.warning("replica %s: %s by the admin API", replica.id, "draining" if drain else "undrained")
        return web.json_response({
            "id": replica.id, "draining": replica.draining, "inflight": len(replica.inflight),
        })

    return handler


def add_routes(app: web.Application, *, admin: bool = True) -> None:
    """The API; with `admin`, also /metrics and /admin/* (else they are on their own listener:
    `kvgate.api.admin`)."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    if admin:
        add_admin_routes(app, health_too=False)


def add_admin_routes(app: web.Application, *, health_too: bool = True) -> None:
    if health_too:
        app.router.add_get("/health", health)
    app.router.add_get("/admin/prompts", admin_prompts)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/replicas", admin_replicas)
    app.router.add_post("/admin/replicas/{replica}/drain", _drain_handler(True))
    app.router.add_post("/admin/replicas/{replica}/undrain", _drain_handler(False))
