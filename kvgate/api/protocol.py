"""The HTTP connection layer under kvgate: limits on clients before any handler runs.

aiohttp answers malformed HTTP (a negative Content-Length, Content-Length beside
Transfer-Encoding, a 2 MB header line, thousands of headers) itself, before any middleware:
with a text/plain body and an ERROR traceback per request. A client can fill the log that way.
Here the same refusals come back in OpenAI's error shape (431 for headers too large), and the
log gets at most one WARNING per client address per `REPORT_EVERY_S`, counting the rest.

Also here, because they concern connections rather than requests:

- `max_connections`: a connection beyond the cap is answered 503 (OpenAI's shape, `code:
  too_many_connections`, `Retry-After: 1`) and closed, before its request is read.
- the header read timeout: aiohttp's keep-alive timer runs from the moment a connection opens
  and closes it if no whole request has arrived when it fires, so a header section that
  trickles in is cut off after `keepalive_timeout` (config `server.client_timeout_s`). The
  body's own timeout is in `kvgate.request.parsed.read_body`.

aiohttp builds its `Server` inside `Application._make_handler` and offers no seam to choose the
protocol class, so `GuardedRunner` re-classes the server it made (`GuardedServer` only adds
`__call__`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvgate.config import ServerConfig

log = logging.getLogger("kvgate.http")

REPORT_EVERY_S = 60.0
_REMEMBERED_PEERS = 1024


class Reports:
    """At most one WARNING per peer per `every_s`; the next one says how many were held back."""

    def __init__(self, every_s: float = REPORT_EVERY_S) -> None:
        self.every_s = every_s
        self._peers: OrderedDict[str, tuple[float, int]] = OrderedDict()  # last report, held

    def report(self, peer: str, what: str) -> None:
        now = time.monotonic()
        last = self._peers.pop(peer, None)
        if last is not None and now - last[0] < self.every_s:
            self._peers[peer] = (last[0], last[1] + 1)
            return
        held = f" ({last[1]} more since the last report)" if last and last[1] else ""
        log.warning("malformed HTTP from %s refused: %s%s", peer, what, held)
        self._peers[peer] = (now, 0)
        while len(self._peers) > _REMEMBERED_PEERS:
            self._peers.popitem(last=False)


def error_body(message: str, code: str, type_: str = "invalid_request_error") -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})


class GuardedRequestHandler(RequestHandler):
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        server = self._manager
        assert isinstance(server, GuardedServer)
        cap = server.max_connections
        if cap is not None and len(server.connections) > cap:
            server.refused_connections += 1
            server.count("too_many_connections")
            body = error_body(
                f"kvgate is at its limit of {cap} client connections; retry shortly",
                "too_many_connections", "service_unavailable",
            )
            transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp calls this for what its parser refused (and for a handler that raised past
        every middleware, which kvgate's errors middleware does not let happen)."""
        server = self._manager
        assert isinstance(server, GuardedServer)
        code, text = "invalid_request", "malformed HTTP request"
        if isinstance(exc, LineTooLong) or "Too many headers" in str(message or ""):
            status, code = 431, "request_header_fields_too_large"
            text = "request header fields too large"
        elif status >= 500:
            code, text = "internal_error", "kvgate failed to handle this request"
        detail = (message or "").splitlines()[0][:200] if message else ""
        if not (self._request_count == 1 and isinstance(exc, BadHttpMethod)):
            server.reports.report(request.remote or "unknown", f"{status} {detail or text}")
        server.count(code)
        if request.writer.output_size > 0:  # a response had started: the connection is broken
            raise ConnectionError("a response was already sent on this connection")
        body = error_body(f"{text}: {detail}" if detail else text, code,
                          "server_error" if status >= 500 else "invalid_request_error")
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()
        return response


class GuardedServer(web.Server):
    max_connections: int | None = None
    refused_connections: int = 0
    reports: Reports
    count: Callable[[str], None]  # kvgate_client_refusals_total{reason}

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections are `GuardedRequestHandler`s."""

    def __init__(
        self,
        app: web.Application,
        *,
        max_connections: int | None = None,
        count: Callable[[str], None] = lambda reason: None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections
        self.count = count

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GuardedServer
        assert isinstance(server, GuardedServer)
        server.max_connections = self.max_connections
        server.refused_connections = 0
        server.reports = Reports()
        server.count = self.count
        return server


def gateway_runner(app: web.Application, server: ServerConfig, **kwargs: Any) -> GuardedRunner:
    """The runner kvgate serves with: its client limits from `server`, kvgate's own access
    log (aiohttp's is off), handlers cancelled when their client goes away."""
    from kvgate.api.routes import GATEWAY

    metrics = app[GATEWAY].metrics if GATEWAY in app else None
    return GuardedRunner(
        app, max_connections=server.max_connections, keepalive_timeout=server.client_timeout_s,
        handler_cancellation=True, access_log=None,
        count=(lambda reason: None) if metrics is None
        else (lambda reason: metrics.client_refusals.labels(reason).inc()),
        **kwargs,
    )
