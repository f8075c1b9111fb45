"""What one request is, for its metrics, logs and headers: filled in by the request path as it
learns it, kept on the aiohttp request under `REQUEST_INFO`."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web


@dataclass(slots=True)
class RequestInfo:
    """Labels for the metrics of one request, filled in as the path learns them."""

    request_id: str  # the client's X-Request-Id if it sent a sane one, echoed and forwarded
    started: float
    key: str  # kvgate's own id for the request: clients may send the same X-Request-Id twice
    model: str = "unknown"
    pool: str = "none"
    tenant: str = "unknown"
    disconnected: bool = False  # the client left before it had the whole answer
    delivered: bool = False  # the client was sent the whole answer
    replica: str | None = None
    prompt_tokens: int | None = None  # kvgate's estimate of vLLM's count
    reserved_blocks: int | None = None
    charged_tokens: int | None = None  # what the tenant paid in the end
    max_tokens: int | None = None  # per sequence, as bounded
    worst_case_blocks: int | None = None
    queue_wait_s: float | None = None  # time waiting for KV capacity, when admitted
    ttft_s: float | None = None  # arrival to the first streamed token
    fingerprint: str | None = None  # the normalized prefix's (tools + system prompt)


REQUEST_INFO = web.RequestKey("kvgate_request", RequestInfo)
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def new_request_info(request: web.Request) -> RequestInfo:
    return request_info(request.headers)


def request_info(headers: Mapping[str, str]) -> RequestInfo:
    """A new request's record, with the client's X-Request-Id where it is sane (`headers`:
    case-insensitive)."""
    key = os.urandom(16).hex()
    given = headers.get("X-Request-Id", "")
    # echoed in a response header: visible ASCII only, nothing a header could be split on
    request_id = given if 0 < len(given) <= 128 and _VISIBLE_ASCII.fullmatch(given) else key
    return RequestInfo(request_id=request_id, started=time.monotonic(), key=key)
