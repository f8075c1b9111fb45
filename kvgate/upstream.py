"""Forwarding to a replica and relaying its answer: headers, timeouts, SSE relay, usage.

Every stream asks the replica for usage (`stream_options.include_usage`), so kvgate always
learns the real token counts; the usage chunk is stripped from the client's stream when the
client did not ask for it. Chunks are relayed as they arrive, never buffered whole, and each
write waits for the client to drain (backpressure). Failures before the response starts raise
a `KvgateError` (mapped to 502/503/504 by the error middleware; vLLM's overload 503 raises
`ReplicaBusy`, which the gateway places again); failures after it started are sent as a final
SSE `data: {"error": ...}` event and the stream ends cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from kvgate.backpressure import overload_reason
from kvgate.config import TimeoutsConfig
from kvgate.errors import KvgateError, ReplicaBusy, UpstreamError, UpstreamTimeout
from kvgate.idle import IdleTimeout
from kvgate.replicas import Replica

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
        "Accept-Encoding", "Content-Encoding",
    )
)
# Client headers that only concern kvgate and are never sent on.
PRIVATE = frozenset({"x-tenant-id"})


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class Outcome:
    """What happened on the wire, for settling and metrics."""

    status: int = 0
    usage: Usage | None = None
    streamed_tokens: int = 0  # content chunks relayed (≈ tokens; vLLM sends one per token)
    sent_at: float | None = None  # when the request went to the replica
    token_rate: float | None = None  # the replica's recent output tokens/s per sequence then
    first_token_at: float | None = None
    done: bool = False  # the client was sent the whole answer ([DONE], or the full body)
    client_disconnected: bool = False
    upstream_failed: bool = False
    unreachable: bool = False  # the request never got to the replica (connection failed)
    timed_out: bool = False  # no response headers within first_byte_s
    busy: str | None = None  # vLLM's queue limits refused it (their reason): not a failure
    # called with the status as soon as the replica's response headers arrive
    on_answer: Callable[[int], None] | None = None

    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage else self.streamed_tokens


def upstream_headers(
    incoming: Mapping[str, str], request_id: str, replica: Replica, *, drop_authorization: bool
) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lowered = name.lower()
        if lowered in HOP_BY_HOP or lowered in PRIVATE:
            continue
        if lowered == "authorization" and (drop_authorization or replica.api_key):
            continue
        headers.add(name, value)
    if replica.api_key:
        headers["Authorization"] = f"Bearer {replica.api_key}"
    headers["X-Request-Id"] = request_id
    headers["Content-Type"] = "application/json"
    headers["Accept-Encoding"] = "identity"  # SSE is relayed and inspected as it arrives
    return headers


def _openai_error_body(raw: bytes, status: int) -> dict[str, Any]:
    """A replica's error body in OpenAI's shape (vLLM's older form has the fields at top level)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        body = dict(error)
    elif isinstance(data, dict) and "message" in data:
        body = {k: data.get(k) for k in ("message", "type", "param", "code")}
    else:
        text = error if isinstance(error, str) else raw.decode("utf-8", "replace")[:500]
        body = {"message": text}
    message = str(body.get("message") or f"upstream answered {status}")
    code = body.get("code")
    if status == 400 and "context length" in message.lower():
        code = "context_length_exceeded"
    return {"error": {
        "message": message,
        "type": str(body.get("type") or "upstream_error"),
        "param": body.get("param"),
        "code": code,
    }}


class Relay:
    """Forwards over the pooled client session (replaced whole when a reload changes
    `upstream`), under the timeouts of the request's own config."""

    def __init__(self, session: aiohttp.ClientSession | None) -> None:
        self.session = session  # opened by the app once its event loop runs

    async def forward(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any] | bytes,
        headers: CIMultiDict[str],
        replica: Replica,
        response_headers: Mapping[str, str],
        *,
        stream: bool,
        client_wants_usage: bool,
        outcome: Outcome,
        timeouts: TimeoutsConfig,
    ) -> web.StreamResponse:
        """Send `body` to the replica and relay its answer under `timeouts`; `outcome` is
        filled in as it goes (so a caller that is cancelled midway still knows what was
        streamed)."""
        t = timeouts
        assert self.session is not None, "the app's services are not started"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, connect=t.connect_s)
        deadline = time.monotonic() + t.total_s
        outcome.sent_at = time.monotonic()
        try:
            async with asyncio.timeout(min(t.first_byte_s, t.total_s)):
                upstream = await self.session.post(
                    f"{replica.url}{path}",
                    data=body if isinstance(body, bytes) else orjson.dumps(body), headers=headers,
                    timeout=timeout, auto_decompress=False,
                )
        except aiohttp.ConnectionTimeoutError:  # (also a TimeoutError) it never got the request
            outcome.upstream_failed = outcome.unreachable = True
            raise UpstreamError(
                f"replica {replica.id} could not be reached within {t.connect_s:g}s"
            ) from None
        except TimeoutError:
            outcome.upstream_failed = outcome.timed_out = True
            raise UpstreamTimeout(
                f"replica {replica.id} did not answer within {t.first_byte_s:g}s"
            ) from None
        except aiohttp.ClientError as exc:
            outcome.upstream_failed = True
            outcome.unreachable = isinstance(exc, aiohttp.ClientConnectorError)
            raise UpstreamError(f"replica {replica.id} could not be reached: {exc}") from None
        async with upstream:
            outcome.status = upstream.status
            if outcome.on_answer is not None:
                outcome.on_answer(upstream.status)
            if upstream.status >= 400 or not stream:
                return await self._relay_whole(upstream, replica, response_headers, outcome, deadline)
            return await self._relay_stream(
                request, upstream, replica, response_headers, outcome, deadline, t.idle_s,
                client_wants_usage,
            )

    async def _relay_whole(
        self,
        upstream: aiohttp.ClientResponse,
        replica: Replica,
        response_headers: Mapping[str, str],
        outcome: Outcome,
        deadline: float,
    ) -> web.StreamResponse:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                raw = await upstream.read()
        except TimeoutError:
            outcome.upstream_failed = True
            raise UpstreamTimeout(f"replica {replica.id} did not finish in time") from None
        except aiohttp.ClientError as exc:
            outcome.upstream_failed = True
            raise UpstreamError(f"replica {replica.id} failed mid-response: {exc}") from None
        status = upstream.status
        if status >= 500:
            detail = _openai_error_body(raw, status)["error"]["message"]
            busy = overload_reason(status, raw)
            if busy is not None:
                outcome.busy = busy
                raise ReplicaBusy(f"replica {replica.id} is busy: {detail}", reason=busy)
            outcome.upstream_failed = True
            error: KvgateError = UpstreamError(f"replica {replica.id} answered {status}: {detail}")
            if status == 503:
                error.status = 503
            raise error
        if status >= 400:
            return web.json_response(
                _openai_error_body(raw, status), status=status, headers=response_headers,
                dumps=lambda v: orjson.dumps(v).decode(),
            )
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            outcome.upstream_failed = True
            raise UpstreamError(f"replica {replica.id} answered with invalid JSON") from None
        usage = data.get("usage") if isinstance(data, dict) else None
        outcome.usage = _usage(usage)
        outcome.first_token_at = time.monotonic()
        outcome.done = True
        return web.Response(
            body=raw, status=status, headers=response_headers, content_type="application/json"
        )

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        replica: Replica,
        response_headers: Mapping[str, str],
        outcome: Outcome,
        deadline: float,
        idle: float,
        client_wants_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers=response_headers)
        response.content_type = "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(request)
        buffer = b""
        loop = asyncio.get_running_loop()
        writing = False
        limit: IdleTimeout | None = None
        try:
            # One idle timeout for the whole stream, both while reading from the replica and
            # while writing to the client (a client that stops reading holds no more than the
            # transport's buffer, and only for one idle gap), and the total deadline; each
            # chunk only notes the time (see kvgate/idle.py).
            until = loop.time() + (deadline - time.monotonic())
            async with IdleTimeout(idle, until) as limit:
                while True:
                    chunk = await upstream.content.readany()
                    limit.touch()
                    if not chunk:
                        break
                    if not buffer and chunk.endswith(b"\n\n") and b"\r" not in chunk:
                        complete = chunk  # whole events, as vLLM writes them: no copying
                    else:
                        buffer += chunk.replace(b"\r\n", b"\n")
                        end = buffer.rfind(b"\n\n")
                        if end < 0:
                            continue
                        complete, buffer = buffer[: end + 2], buffer[end + 2 :]
                    usage_at = complete.find(b'"usage"')
                    if usage_at < 0:  # relayed as received, in one write
                        out = complete
                        self._count_tokens(complete, outcome)
                    else:
                        # the events before the first that mentions usage go as they are; from
                        # there on, event by event (its usage may need stripping)
                        start = complete.rfind(b"\n\n", 0, usage_at) + 2  # 1: the first
                        head = complete[:start] if start > 1 else b""
                        self._count_tokens(head, outcome)
                        out = head + self._filter(
                            complete[len(head):].split(b"\n\n"), outcome, client_wants_usage
                        )
                    if out:
                        writing = True
                        await self._write(response, out, outcome)
                        writing = False
                        limit.touch()
            if buffer.strip():
                out = self._filter([buffer], outcome, client_wants_usage)
                if out:
                    await self._write(response, out, outcome)
        except TimeoutError:
            at_deadline = limit is not None and limit.reason == "deadline"
            if writing and not at_deadline:  # the client stopped reading
                outcome.client_disconnected = True
                if request.transport is not None:
                    request.transport.abort()
                return response
            outcome.upstream_failed = True
            await self._send_error(response, UpstreamTimeout(
                f"replica {replica.id} exceeded the total time limit" if at_deadline
                else f"replica {replica.id} sent nothing for {idle:g}s mid-stream"
            ))
        except aiohttp.ClientError as exc:
            if outcome.client_disconnected:
                return response
            outcome.upstream_failed = True
            await self._send_error(response, UpstreamError(
                f"replica {replica.id} broke the stream: {exc or type(exc).__name__}"
            ))
        except ConnectionResetError:
            outcome.client_disconnected = True
            return response
        await self._close_quietly(response)
        return response

    def _filter(
        self,
        events: list[bytes],
        outcome: Outcome,
        client_wants_usage: bool,
    ) -> bytes:
        out = []
        tokens = 0
        for event in events:
            if not event.strip():
                continue
            if b'"usage"' in event and event.startswith(b"data:"):
                usage, has_choices = _usage_event(event)
                if usage is not None:
                    outcome.usage = usage
                    if not has_choices and not client_wants_usage:
                        continue
            if (b'"content":"' in event and b'"content":""' not in event) or (
                b'"text":"' in event and b'"text":""' not in event
            ):
                tokens += 1
            out.append(event)
            out.append(b"\n\n")
        if tokens:
            if outcome.first_token_at is None:
                outcome.first_token_at = time.monotonic()
            outcome.streamed_tokens += tokens
        return b"".join(out)

    @staticmethod
    def _count_tokens(events: bytes, outcome: Outcome) -> None:
        """Count the content chunks in whole events at C speed: vLLM sends one choice per
        event, so each non-empty `content` (chat) or `text` (completions) is one event."""
        tokens = events.count(b'"content":"')
        if tokens:
            tokens -= events.count(b'"content":""')
        elif b'"text":"' in events:
            tokens = events.count(b'"text":"') - events.count(b'"text":""')
        if tokens:
            if outcome.first_token_at is None:
                outcome.first_token_at = time.monotonic()
            outcome.streamed_tokens += tokens

    @staticmethod
    async def _write(response: web.StreamResponse, data: bytes, outcome: Outcome) -> None:
        try:
            await response.write(data)
        except ConnectionResetError:
            outcome.client_disconnected = True
            raise
        if data.endswith(b"data: [DONE]\n\n"):
            outcome.done = True

    @staticmethod
    async def _send_error(response: web.StreamResponse, error: KvgateError) -> None:
        """The stream has started: the error goes as a last SSE event, then the stream ends."""
        with contextlib.suppress(ConnectionResetError):
            await response.write(b"data: " + orjson.dumps(error.body()) + b"\n\n")

    @staticmethod
    async def _close_quietly(response: web.StreamResponse) -> None:
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()


def _usage(value: Any) -> Usage | None:
    if not isinstance(value, dict):
        return None
    prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        return Usage(prompt, completion)
    return None


def _usage_event(event: bytes) -> tuple[Usage | None, bool]:
    try:
        data = orjson.loads(event[5:].strip())
    except orjson.JSONDecodeError:
        return None, True
    if not isinstance(data, dict):
        return None, True
    return _usage(data.get("usage")), bool(data.get("choices"))
