"""How a request ended, recorded once, whichever data plane served it (the HTTP proxy's
middleware, the picker's stream): counted by outcome in `kvgate_requests_total`, timed, its
refusal reason counted, and, with `server.access_log`, one JSON line on `kvgate.access`.

    finish(metrics, config, exchange, status, error)

`error` is what ended it, if anything did: the client leaving (`asyncio.CancelledError`,
recorded as 499), or a `KvgateError` (its status and refusal reason). Without one, the
status the client was answered with says how it went.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Literal

import orjson

from kvgate.config import Config
from kvgate.errors import KvgateError
from kvgate.metrics import Metrics

if TYPE_CHECKING:  # the exchange's module imports the request path's, this one among them
    from kvgate.exchange import Exchange

access_log = logging.getLogger("kvgate.access")  # one JSON line per request, when enabled
Outcome = Literal["ok", "disconnected", "client_error", "refused", "upstream_error"]
CLIENT_LEFT = 499  # nginx's status for a client that closed the connection


def finish(
    metrics: Metrics, config: Config, x: Exchange, status: int, error: BaseException | None = None
) -> None:
    """Record how the request ended: the one place for it."""
    reason = error.refusal_reason if isinstance(error, KvgateError) else None
    outcome = outcome_of(x, status, error)
    duration = time.monotonic() - x.started
    pool = x.pool_label
    metrics.requests.labels(x.model, pool, x.tenant_name, outcome).inc()
    if outcome in ("ok", "disconnected", "client_error"):
        metrics.duration.labels(pool, x.model).observe(duration)
    if reason is not None:
        metrics.refusals.labels(pool, x.tenant_name, reason).inc()
    if config.server.access_log:
        access_log.info("%s", access_line(x, outcome, status, reason, duration))


def outcome_of(x: Exchange, status: int, error: BaseException | None) -> Outcome:
    if isinstance(error, asyncio.CancelledError):
        # a client that hangs up once it has [DONE] got its answer: that is not a disconnect
        return "ok" if x.delivered else "disconnected"
    if isinstance(error, KvgateError):
        return "refused" if error.status < 500 else "upstream_error"
    if x.disconnected:
        return "disconnected"
    if status >= 500:
        return "upstream_error"
    return "client_error" if status >= 400 else "ok"


def access_line(
    x: Exchange, outcome: str, status: int, reason: str | None, duration: float
) -> str:
    """One request's access-log record as JSON: what it asked, where it went, what it cost and
    how it ended. Never the prompt, never a key (the tenant is its configured name)."""
    bound = None if x.sized is None else x.sized.bound
    slot = x.slot
    return orjson.dumps({
        "request_id": x.request_id, "tenant": x.tenant_name, "model": x.model,
        "pool": x.pool_label, "replica": x.replica, "status": status, "outcome": outcome,
        "refusal_reason": reason,
        "prompt_tokens": None if bound is None else bound.prompt_tokens,
        "max_tokens": None if bound is None else bound.max_tokens,
        "worst_case_blocks": None if slot is None else slot.worst_blocks,
        "reserved_blocks": None if slot is None else slot.reserved_blocks,
        "charged_tokens": x.charged_tokens,
        "queue_wait_s": _seconds(None if slot is None else slot.queued_s),
        "ttft_s": _seconds(x.ttft_s), "duration_s": _seconds(duration),
    }).decode()


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
