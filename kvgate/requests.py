"""The parsed request: what kvgate reads from an OpenAI request body, validated.

The fields kvgate interprets are checked here; every other field the OpenAI API defines is
checked by type and range in `kvgate.schema`; fields neither knows (vLLM's extensions such as
`ignore_eos`, `chat_template_kwargs`, `guided_json`) pass through untouched. Bad input raises
`BadRequest` naming the field, and is never forwarded.

A large body is parsed off the event loop (`parse_request`): parsing and validation are linear
in the body, and 8 MB of tiny messages would otherwise hold the loop for about half a second.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from kvgate import schema
from kvgate.errors import BadRequest, PayloadTooLarge, RequestTimeout

# No model has a context this long; a larger max_tokens is a client bug, not a request.
ABSURD_MAX_TOKENS = 10_000_000


class Endpoint(enum.Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


# Bodies above this are parsed in a worker thread (about 1 ms of parsing on the loop).
OFF_LOOP_BYTES = 256 * 1024
DEFAULT_MAX_MESSAGES = 4096
# vLLM's body field `priority` orders its own queue (lower runs earlier, default 0). kvgate's
# tenant classes decide who goes first, so a client may lower its own request (>= 0) but never
# raise it above everyone else's.


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    body: dict[str, Any]  # the client's body; copy before changing it for upstream
    model: str
    stream: bool
    client_wants_usage: bool  # stream_options.include_usage as the client sent it
    max_tokens: int | None  # as the client sent it (max_completion_tokens counts too)
    sequences: int  # n (or best_of): sequences generated in parallel, each up to max_tokens
    user: str | None

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body.get("messages") or []


async def parse_request(
    raw: bytes, endpoint: Endpoint, max_messages: int = DEFAULT_MAX_MESSAGES
) -> ParsedRequest:
    """`parse_body`, off the event loop when the body is large."""
    if len(raw) <= OFF_LOOP_BYTES:
        return parse_body(raw, endpoint, max_messages)
    return await asyncio.to_thread(parse_body, raw, endpoint, max_messages)


def parse_body(
    raw: bytes, endpoint: Endpoint, max_messages: int = DEFAULT_MAX_MESSAGES
) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")

    priority = body.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or priority < 0
    ):
        raise BadRequest(
            "'priority' must be an integer >= 0: a client may lower its request's priority on "
            "the replica, never raise it (kvgate's tenant classes decide who goes first)",
            param="priority",
        )

    if endpoint is Endpoint.CHAT:
        schema.check_count(body.get("messages"), max_messages, "messages")
        _check_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            schema.check_count(prompt, max_messages, "prompt")  # a batch of prompts
        _check_prompt(prompt)

    stream = body.get("stream")
    if stream is None:  # as vLLM: null means the default
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    wants_usage = bool(options and options.get("include_usage") is True)

    max_tokens = _max_tokens(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", param="user")
    schema.validate(body, chat=endpoint is Endpoint.CHAT)
    schema.check_encodable(body)
    return ParsedRequest(
        endpoint=endpoint,
        body=body,
        model=model,
        stream=stream,
        client_wants_usage=wants_usage,
        max_tokens=max_tokens,
        sequences=_sequences(body),
        user=user,
    )


MAX_SEQUENCES = 128


def _sequences(body: dict[str, Any]) -> int:
    count = 1
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SEQUENCES:
            raise BadRequest(f"'{field}' must be an integer from 1 to {MAX_SEQUENCES}", param=field)
        count = max(count, value)
    return count


def _max_tokens(body: dict[str, Any]) -> int | None:
    """The completion limit vLLM will apply: `max_completion_tokens` when given, else
    `max_tokens` (vLLM reads `max_completion_tokens or max_tokens`)."""
    found = None
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"'{field}' must be an integer", param=field)
        if value < 1:
            raise BadRequest(f"'{field}' must be at least 1, got {value}", param=field)
        if value > ABSURD_MAX_TOKENS:
            raise BadRequest(f"'{field}' of {value} is beyond any model's context", param=field)
        if found is None:
            found = value
    return found


def _check_messages(messages: Any) -> None:
    if messages is None:
        raise BadRequest("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"'{where}' must be an object", param=where)
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"'{where}.role' must be a string", param=f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"'{where}.content' must be a string or an array of parts", param=f"{where}.content"
            )
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise BadRequest(
                        f"'{where}.content[{j}]' must be an object with a 'type'",
                        param=f"{where}.content",
                    )
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"'{where}.name' must be a string", param=f"{where}.name")
        calls = message.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise BadRequest(
                f"'{where}.tool_calls' must be an array of objects", param=f"{where}.tool_calls"
            )


def _check_prompt(prompt: Any) -> None:
    if prompt is None:
        raise BadRequest("'prompt' is required", param="prompt")
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) and p for p in prompt):
            return
        if all(_token_id(p) for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_token_id(t) for t in p) for p in prompt):
            return
    raise BadRequest(
        "'prompt' must be a non-empty string, an array of non-empty strings, or an array of "
        "token ids", param="prompt"
    )


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def read_body(request: web.Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, at most `limit` bytes, within `timeout_s` (a body that trickles in
    would hold its connection and its handler as long as the client likes)."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
    chunks = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_chunked(65536):
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g}s", headers={"Connection": "close"}
        ) from None
    return b"".join(chunks)
