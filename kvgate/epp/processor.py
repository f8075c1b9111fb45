"""kvgate as Envoy's external processor: the Gateway API Inference Extension's endpoint picker.

For each HTTP request Envoy opens a stream (`Process`). An OpenAI request runs the request
path of proxy mode (`Gateway.run`) with the Envoy data plane (`kvgate.epp.plane`):

    request headers   go on, less the headers only the picker may set
    request body      read whole → parse & validate, identify, normalize, count, bound, charge,
                      route, admit (the stream waits in the fair queue) → the pick
    response headers  kvgate's headers added; 400 or more read whole first
    response body     passed on chunk by chunk, its tokens and usage followed → settle

A refusal (400, 401, 403, 404, 405, 413, 429 with Retry-After, 503) is Envoy's
`ImmediateResponse` in OpenAI's shape: nothing is forwarded. `GET /v1/models` is answered as
kvgate's own port answers it; any other path is a 404, as there. A stream Envoy resets before
the answer is over (the client left) cancels the request path, which releases everything as
in proxy mode; a reset once the whole answer went on is Envoy closing the exchange, and the
request path finishes its books first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from multidict import CIMultiDict, CIMultiDictProxy

from kvgate.epp.plane import EnvoyRequest, Phase
from kvgate.epp.stream import (
    SYSTEM_OWNED,
    EnvoyStream,
    header_pairs,
    headers_reply,
    immediate,
    immediate_json,
    source_address,
    subset_of,
    unchanged,
)
from kvgate.errors import (
    KvgateError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ServerError,
)
from kvgate.exchange import Exchange
from kvgate.gateway import Gateway
from kvgate.request.ending import CLIENT_LEFT, finish
from kvgate.request.parsed import Endpoint
from kvgate.transport.breaker import BreakerTransport
from kvgate.transport.plane import Plane

log = logging.getLogger(__name__)

ENDPOINTS = {e.value: e for e in Endpoint}
MODELS = "/v1/models"
DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
# How Envoy may send the request's body: whole, or in full duplex (kvgate reads it all, then
# picks, then streams it on); and the answer's: through kvgate (chunk by chunk, whole, or in
# full duplex), or not at all.
REQUEST_BODY_MODES = {ProcessingMode.BUFFERED, DUPLEX}
RESPONSE_BODY_MODES = {ProcessingMode.STREAMED, ProcessingMode.BUFFERED,
                       ProcessingMode.BUFFERED_PARTIAL, ProcessingMode.NONE, DUPLEX}  # fmt: skip


def body_modes(first: ProcessingRequest) -> tuple[int, int]:
    """The request's and the answer's body modes Envoy says it will use (its first message's
    protocol_config; an Envoy that does not say: BUFFERED and STREAMED, as kvgate's Envoy
    config sets them). kvgate picks before anything of the request is sent on, so its body
    must come whole or in full duplex (where Envoy holds the request until the pick)."""
    if not first.HasField("protocol_config"):
        return int(ProcessingMode.BUFFERED), int(ProcessingMode.STREAMED)
    config = first.protocol_config
    name = ProcessingMode.BodySendMode.Name
    if config.request_body_mode not in REQUEST_BODY_MODES:
        raise ServerError(
            f"Envoy's request_body_mode is {name(config.request_body_mode)}: kvgate needs "
            "BUFFERED or FULL_DUPLEX_STREAMED, so that it picks before anything is sent on"
        )
    if config.response_body_mode not in RESPONSE_BODY_MODES:
        raise ServerError(
            f"Envoy's response_body_mode {name(config.response_body_mode)} is not one kvgate "
            "follows: use FULL_DUPLEX_STREAMED or STREAMED (the body through kvgate), or NONE "
            "(headers only)"
        )
    return int(config.request_body_mode), int(config.response_body_mode)


class Processor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        stream = EnvoyStream(context)
        try:
            await self.exchange(stream, context)
        finally:
            await stream.close()

    async def exchange(self, stream: EnvoyStream, context: grpc.aio.ServicerContext) -> None:
        first = await stream.next()
        if first is None:
            return
        if first.WhichOneof("request") != "request_headers":  # not a filter kvgate knows
            await stream.answer(unchanged(first))
            await stream.pass_through()
            return
        pairs = header_pairs(first.request_headers.headers)
        pseudo = {name: value for name, value in reversed(pairs) if name.startswith(":")}
        path = pseudo.get(":path", "").partition("?")[0]
        method = pseudo.get(":method", "")
        client = CIMultiDictProxy(CIMultiDict(
            (name, value) for name, value in pairs if not name.startswith(":")
        ))
        x = Exchange.arriving(client, self.gateway.runtime)
        endpoint = ENDPOINTS.get(path)
        if endpoint is None or method != "POST":
            await self.not_a_request(stream, x, method, path, endpoint is not None)
            return
        x.endpoint = endpoint
        envoy = EnvoyRequest(stream, client)
        envoy.bodyless = first.request_headers.end_of_stream
        work = asyncio.ensure_future(self.decide(stream, first, x, envoy))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            if envoy.phase.delivered:  # the whole answer went on: Envoy's close
                await work  # the request path finishes its books
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                return
            work.cancel()  # the client left: the request path ends, and releases everything
            with contextlib.suppress(asyncio.CancelledError):
                await work
            raise
        phase = envoy.phase
        if phase.abandoned or (phase is Phase.PICKED and stream.pending is None):
            # kvgate stopped following an answer under way: Envoy must end it
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "kvgate ended the exchange")
        await stream.pass_through()

    async def decide(
        self, stream: EnvoyStream, first: ProcessingRequest, x: Exchange, envoy: EnvoyRequest
    ) -> None:
        """The request path for one OpenAI request, recorded by how it ended."""
        try:
            request_mode, response_mode = body_modes(first)
            stream.duplex = frozenset(phase for phase, mode in (
                ("request_body", request_mode), ("response_body", response_mode)
            ) if mode == DUPLEX)
            if request_mode != DUPLEX:  # in full duplex, the headers' answer is the pick
                await stream.answer(headers_reply("request_headers", {}, remove=SYSTEM_OWNED))
            envoy.sees_body = response_mode != ProcessingMode.NONE
            x.raw = envoy.raw = await self.body(stream, first, x.rt.config.server.max_body_bytes)
            plane = Plane(
                BreakerTransport(envoy, self.gateway.breakers), envoy.deliver,
                retries=False, subset=subset_of(first), sees_body=envoy.sees_body,
            )
            await self.gateway.run(x, source_address(first), plane)
        except asyncio.CancelledError as exc:  # Envoy reset the stream: the client left
            self.ended(x, CLIENT_LEFT, exc)
            raise
        except Exception as exc:
            if not isinstance(exc, KvgateError):
                log.exception("unhandled error processing %s", x.endpoint and x.endpoint.value)
            error = exc if isinstance(exc, KvgateError) else ServerError(
                "kvgate failed to handle this request; see its logs"
            )
            self.ended(x, error.status, error)
            if await stream.answer_if_pending(immediate(error, x.request_id)):
                envoy.deliver_done()  # the client has kvgate's answer instead
        else:
            self.ended(x, 200)

    def ended(self, x: Exchange, status: int, error: BaseException | None = None) -> None:
        finish(self.gateway.metrics, x.rt.config, x, status, error)

    async def not_a_request(
        self, stream: EnvoyStream, x: Exchange, method: str, path: str, known: bool
    ) -> None:
        """What kvgate's own port answers for it: its model list, a 405 or a 404."""
        if method == "GET" and path == MODELS:
            await stream.answer(immediate_json(
                200, self.gateway.registry.model_list(), {"x-request-id": x.request_id}, "kvgate_models"
            ))
            return
        error: KvgateError = (
            MethodNotAllowed("method not allowed here; use POST", headers={"Allow": "POST"})
            if known else NotFound("no such endpoint", code="unknown_url")
        )
        await stream.answer(immediate(error, x.request_id))

    async def body(self, stream: EnvoyStream, first: ProcessingRequest, limit: int) -> bytes:
        """The request's whole body: in the one message Envoy buffers it in, left awaiting its
        answer, the pick; or in full duplex, every chunk up to its end (or its trailers, kept
        for the pick to answer), the headers awaiting the pick."""
        if first.request_headers.end_of_stream:
            return b""
        if "request_body" in stream.duplex:
            return await self.chunks(stream, limit)
        message = await stream.next()
        if message is None or message.WhichOneof("request") != "request_body":
            raise ServerError("Envoy sent no request body: kvgate needs request_body_mode "
                              "BUFFERED or FULL_DUPLEX_STREAMED")
        if not message.request_body.end_of_stream:
            raise ServerError("Envoy streamed the request body: kvgate needs request_body_mode "
                              "BUFFERED or FULL_DUPLEX_STREAMED, so that it picks before "
                              "anything is sent on")
        body = bytes(message.request_body.body)
        if len(body) > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        return body

    async def chunks(self, stream: EnvoyStream, limit: int) -> bytes:
        """Full duplex: the request's body chunks, read up to its end."""
        parts: list[bytes] = []
        size = 0
        while (message := await stream.read_more()) is not None:
            phase = message.WhichOneof("request")
            if phase == "request_trailers":
                stream.trailers = message
                break
            if phase != "request_body":
                raise ServerError(f"Envoy sent {phase} before the request's body ended")
            size += len(message.request_body.body)
            if size > limit:
                raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
            parts.append(message.request_body.body)
            if message.request_body.end_of_stream:
                break
        else:
            raise ServerError("Envoy ended the exchange before the request's body ended")
        return b"".join(parts)
