"""The parsed request: what kvgate reads from an OpenAI request body, validated.

The body is validated once, by `kvgate.request.schema` (every field the OpenAI API defines, and
kvgate's own rules for the fields it reads); fields it does not know (vLLM's extensions such as
`ignore_eos`, `chat_template_kwargs`, `guided_json`) pass through untouched. Bad input raises
`BadRequest` naming the field, and is never forwarded.

Parsing and validation are linear in the body: a large body is parsed in a worker process
(`kvgate.request.front`), never on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, replace
from typing import Any

import orjson
from aiohttp import web

from kvgate.errors import BadRequest, PayloadTooLarge, RequestTimeout
from kvgate.request import schema
from kvgate.request.rules import DEFAULT_MAX_MESSAGES


class Endpoint(enum.Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


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

    @classmethod
    def of(cls, endpoint: Endpoint, body: dict[str, Any], request: schema.Request) -> ParsedRequest:
        """What kvgate reads of a body `schema.validate` accepted as `request`."""
        return cls(
            endpoint=endpoint,
            body=body,
            model=request.model,
            stream=bool(request.stream),  # as vLLM: null means the default
            client_wants_usage=request.client_wants_usage,
            max_tokens=request.token_limit,
            sequences=request.sequences,
            user=request.user,
        )


# The Gateway API Inference Extension's name for the model a gateway serves a request as.
MODEL_REWRITE = "x-gateway-model-name-rewrite"


def with_model(parsed: ParsedRequest, model: str | None) -> ParsedRequest:
    """The request for `model` instead (the gateway's `x-gateway-model-name-rewrite`): so it
    is routed, counted, admitted and sent on; itself where `model` is None or the same."""
    if not model or model == parsed.model:
        return parsed
    return replace(parsed, body={**parsed.body, "model": model}, model=model)


def parse_body(
    raw: bytes, endpoint: Endpoint, max_messages: int = DEFAULT_MAX_MESSAGES
) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    request = schema.validate(body, chat=endpoint is Endpoint.CHAT, max_messages=max_messages)
    return ParsedRequest.of(endpoint, body, request)


async def read_body(request: web.Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, at most `limit` bytes, within `timeout_s` (a body that trickles in
    would hold its connection and its handler as long as the client likes)."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
    content = request.content
    if content.is_eof():  # it has all arrived (a small body, usually): nothing to wait for
        body = await content.read()
        if len(body) > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        return body
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
