"""The admin surface: /admin/* behind a token, and (optionally) with /metrics on a listener of
its own (config `server.admin`).

- `/admin/*` needs `Authorization: Bearer <token>` whose SHA-256 is `server.admin.token_sha256`
  whenever `server.admin.require_token` is true — by default, whenever `auth.mode` is not none
  (with clients identified by key, the fleet's drain switch must not be open to them). Required
  but not configured: every admin call is refused 403 (locked), never opened.
- `server.admin.port` set: /admin/* and /metrics move to that listener (`server.admin.host`,
  127.0.0.1 by default) and the API listener answers them 404; the token rule is unchanged.
  The listener is read at start; a reload does not move it.

The token is compared in constant time, and is never logged (the config holds its hash).
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from kvgate.api.routes import GATEWAY, Handler, add_admin_routes, errors_middleware
from kvgate.config import Config
from kvgate.errors import Forbidden, Unauthorized
from kvgate.gateway import Gateway
from kvgate.workers import PEERS, Peers

ADMIN_PREFIX = "/admin/"


def token_required(config: Config) -> bool:
    admin = config.server.admin
    return admin.require_token if admin.require_token is not None else config.auth.mode != "none"


def check_admin(config: Config, authorization: str | None) -> None:
    """Raise unless an admin call with this Authorization header may run under `config`."""
    if not token_required(config):
        return
    digest = config.server.admin.token_sha256
    if digest is None:
        raise Forbidden(
            "the admin API is locked: set server.admin.token_sha256 to use it",
            code="admin_locked",
        )
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("the admin API needs 'Authorization: Bearer <admin token>'")
    given = hashlib.sha256(token.strip().encode()).digest()
    if not hmac.compare_digest(given, bytes.fromhex(digest)):
        raise Unauthorized("invalid admin token")


@web.middleware
async def admin_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(ADMIN_PREFIX):
        check_admin(request.app[GATEWAY].runtime.config, request.headers.get("Authorization"))
    return await handler(request)


def build_admin_app(gateway: Gateway) -> web.Application:
    """The admin listener's application: /admin/*, /metrics and /health over the same gateway
    the API listener serves (its background services run in the API application)."""
    app = web.Application(middlewares=[errors_middleware, admin_middleware])
    app[GATEWAY] = gateway
    add_admin_routes(app)
    return app


async def start_admin_listener(
    gateway: Gateway, config: Config, peers: Peers | None = None
) -> web.AppRunner | None:
    """The admin listener, when `server.admin.port` asks for one (else None). One of
    `--workers N` (`peers`): every worker binds the port (SO_REUSEPORT) and its /metrics
    answers for all of them, as the API port's does without an admin listener."""
    admin = config.server.admin
    if admin.port is None:
        return None
    from kvgate.api.protocol import gateway_runner

    app = build_admin_app(gateway)
    if peers is not None:
        app[PEERS] = peers
    runner = gateway_runner(app, config.server)
    await runner.setup()
    await web.TCPSite(runner, admin.host, admin.port, reuse_port=peers is not None or None).start()
    return runner
