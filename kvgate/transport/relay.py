"""Relaying a replica's answer to the client: the gateway's edge I/O.

Every stream asks the replica for usage (`stream_options.include_usage`), so kvgate always
learns the real token counts; the usage chunk is stripped from the client's stream when the
client did not ask for it. Chunks are relayed as they arrive, never buffered whole, and each
write waits for the client to drain (backpressure). Failures before the response starts raise
a `KvgateError` (mapped to 502/503/504 by the error middleware; vLLM's overload 503 raises
`ReplicaBusy`, which the attempts stage places again); failures after it started are sent as
a final SSE `data: {"error": ...}` event and the stream ends cleanly. What it relayed goes
into the attempt's `Outcome` as it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvgate.admission.backpressure import overload_reason
from kvgate.errors import BadAnswer, KvgateError, LateAnswer, ReplicaBusy, StreamBroke
from kvgate.transport.base import Outcome, UpstreamResponse, Usage
from kvgate.transport.idle import IdleTimeout

DONE = b"data: [DONE]\n\n"  # a stream's last event: the client has the whole answer


async def relay(
    client: web.Request,
    answer: UpstreamResponse,
    headers: Mapping[str, str],
    client_wants_usage: bool,
) -> web.StreamResponse:
    """Relay `answer` to `client` with the response `headers`; gives the replica's connection
    back (`answer.aclose`) on every ending."""
    try:
        if answer.status >= 400 or not answer.request.stream:
            return await _relay_whole(answer, headers)
        return await _relay_stream(client, answer, headers, client_wants_usage)
    finally:
        await answer.aclose()


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


async def _relay_whole(answer: UpstreamResponse, headers: Mapping[str, str]) -> web.StreamResponse:
    outcome, replica = answer.request.attempt, answer.request.replica
    try:
        async with asyncio.timeout(max(0.0, answer.deadline - time.monotonic())):
            raw = await answer.read()
    except TimeoutError:
        raise outcome.fail(LateAnswer(f"replica {replica.id} did not finish in time")) from None
    except aiohttp.ClientError as exc:
        raise outcome.fail(
            StreamBroke(f"replica {replica.id} failed mid-response: {exc}")
        ) from None
    error = judge_whole(answer, raw)
    if error is not None:
        return web.json_response(
            error, status=answer.status, headers=headers,
            dumps=lambda v: orjson.dumps(v).decode(),
        )
    return web.Response(
        body=raw, status=answer.status, headers=headers, content_type="application/json"
    )


def judge_whole(answer: UpstreamResponse, raw: bytes) -> dict[str, Any] | None:
    """What a whole answer tells, into the attempt's `Outcome`: its usage, or that it failed.
    Raises `ReplicaBusy` (vLLM's queue limits refused it) or `BadAnswer` (a 5xx, or a
    success that is not JSON); returns a 4xx's error body in OpenAI's shape, else None."""
    outcome, replica = answer.request.attempt, answer.request.replica
    status = answer.status
    if status >= 500:
        detail = _openai_error_body(raw, status)["error"]["message"]
        busy = overload_reason(status, raw)
        if busy is not None:
            raise outcome.fail(ReplicaBusy(f"replica {replica.id} is busy: {detail}", reason=busy))
        error = BadAnswer(f"replica {replica.id} answered {status}: {detail}")
        if status == 503:
            error.status = 503
        raise outcome.fail(error)
    if status >= 400:
        return _openai_error_body(raw, status)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise outcome.fail(BadAnswer(f"replica {replica.id} answered with invalid JSON")) from None
    usage = data.get("usage") if isinstance(data, dict) else None
    outcome.usage = _usage(usage)
    outcome.first_token_at = time.monotonic()
    outcome.done = True
    return None


async def _relay_stream(
    client: web.Request,
    answer: UpstreamResponse,
    headers: Mapping[str, str],
    client_wants_usage: bool,
) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=headers)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(client)
    outcome, replica = answer.request.attempt, answer.request.replica
    idle = answer.request.timeouts.idle_s
    events = Events(functools.partial(_write, response, outcome), outcome, client_wants_usage)
    limit: IdleTimeout | None = None
    try:
        # One idle timeout for the whole stream, both while reading from the replica and
        # while writing to the client (a client that stops reading holds no more than the
        # transport's buffer, and only for one idle gap), and the total deadline; each
        # chunk only notes the time (see kvgate/transport/idle.py).
        until = asyncio.get_running_loop().time() + (answer.deadline - time.monotonic())
        async with IdleTimeout(idle, until) as limit:
            await events.pump(answer.readany, limit)
        await events.flush()
    except TimeoutError:
        at_deadline = limit is not None and limit.reason == "deadline"
        if events.writing and not at_deadline:  # the client stopped reading
            outcome.client_disconnected = True
            if client.transport is not None:
                client.transport.abort()
            return response
        await _send_error(response, outcome.fail(LateAnswer(
            f"replica {replica.id} exceeded the total time limit" if at_deadline
            else f"replica {replica.id} sent nothing for {idle:g}s mid-stream"
        )))
    except aiohttp.ClientError as exc:
        if outcome.client_disconnected:
            return response
        await _send_error(response, outcome.fail(StreamBroke(
            f"replica {replica.id} broke the stream: {exc or type(exc).__name__}"
        )))
    except ConnectionResetError:
        outcome.client_disconnected = True
        return response
    await _close_quietly(response)
    return response


@dataclass(slots=True)
class Events:
    """A stream's SSE events on their way to the client: whole events only, usage noted (and
    stripped where the client did not ask for it), content chunks counted. `write` hands bytes
    to the client's side of the data plane (and notes in the outcome when [DONE] went)."""

    write: Callable[[bytes], Awaitable[None]]
    outcome: Outcome
    client_wants_usage: bool
    buffer: bytes = b""  # the start of an event not yet complete
    writing: bool = False  # waiting for the client to take a write

    async def pump(self, readany: Callable[[], Awaitable[bytes]], limit: IdleTimeout) -> None:
        """Relay chunks until the replica's stream ends."""
        while True:
            chunk = await readany()
            limit.touch()
            if not chunk:
                return
            if not self.buffer and chunk.endswith(b"\n\n") and b"\r" not in chunk:
                complete = chunk  # whole events, as vLLM writes them: no copying
            else:
                self.buffer += chunk.replace(b"\r\n", b"\n")
                end = self.buffer.rfind(b"\n\n")
                if end < 0:
                    continue
                complete, self.buffer = self.buffer[: end + 2], self.buffer[end + 2 :]
            out = self.relayed(complete)
            if out:
                self.writing = True
                await self.write(out)
                self.writing = False
                limit.touch()

    def relayed(self, complete: bytes) -> bytes:
        """What of these whole events goes to the client."""
        usage_at = complete.find(b'"usage"')
        if usage_at < 0:  # relayed as received, in one write
            _count_tokens(complete, self.outcome)
            return complete
        # the events before the first that mentions usage go as they are; from there on,
        # event by event (its usage may need stripping)
        start = complete.rfind(b"\n\n", 0, usage_at) + 2  # 1: the first
        head = complete[:start] if start > 1 else b""
        _count_tokens(head, self.outcome)
        rest = complete[len(head):].split(b"\n\n")
        return head + _filter(rest, self.outcome, self.client_wants_usage)

    async def flush(self) -> None:
        """The stream ended: what is left of an unterminated last event."""
        if self.buffer.strip():
            out = _filter([self.buffer], self.outcome, self.client_wants_usage)
            if out:
                await self.write(out)


def _filter(
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


async def _write(response: web.StreamResponse, outcome: Outcome, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        outcome.client_disconnected = True
        raise
    wrote(outcome, data)


def wrote(outcome: Outcome, data: bytes) -> None:
    """`data` went to the client: if it ends the stream, the client has the whole answer."""
    if data.endswith(DONE):
        outcome.done = True


async def _send_error(response: web.StreamResponse, error: KvgateError) -> None:
    """The stream has started: the error goes as a last SSE event, then the stream ends."""
    with contextlib.suppress(ConnectionResetError):
        await response.write(b"data: " + orjson.dumps(error.body()) + b"\n\n")


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
