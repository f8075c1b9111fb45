"""kvgate as Envoy's external processor: the Gateway API Inference Extension's endpoint picker.

For each HTTP request Envoy opens a stream (`Process`). An OpenAI request runs the request
path of proxy mode (`Gateway.run`) with the Envoy data plane (`kvgate.epp.plane`):

    request headers   go on, less the headers only the picker may set
    request body      read whole → parse & validate, identify, normalize, count, bound, charge,
                      route, admit (the stream waits in the fair queue) → the pick
    response headers  kvgate's headers added; a 5xx read whole first
    response body     passed on chunk by chunk, its tokens and usage followed → settle

A refusal (400, 401, 403, 404, 413, 429 with Retry-After, 503) is Envoy's `ImmediateResponse`
in OpenAI's shape: nothing is forwarded. A stream Envoy resets (the client left) cancels the
request path, which releases everything as in proxy mode. Any other request (health checks,
`/v1/models`) passes through unchanged: Envoy's fallback balancer routes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from multidict import CIMultiDict, CIMultiDictProxy

from kvgate.api.routes import record
from kvgate.epp.plane import EnvoyRequest
from kvgate.epp.stream import (
    SYSTEM_OWNED,
    EnvoyStream,
    headers_of,
    headers_reply,
    immediate,
    source_address,
    subset_of,
)
from kvgate.errors import KvgateError, PayloadTooLarge, ServerError
from kvgate.exchange import Exchange
from kvgate.gateway import Gateway
from kvgate.request.info import RequestInfo, request_info
from kvgate.request.parsed import Endpoint
from kvgate.transport.breaker import BreakerTransport
from kvgate.transport.plane import Plane

log = logging.getLogger(__name__)

ENDPOINTS = {("POST", e.value): e for e in Endpoint}
# How Envoy may send the answer's body: through kvgate chunk by chunk (or whole), or not at all.
BODY_MODES = {ProcessingMode.STREAMED, ProcessingMode.BUFFERED, ProcessingMode.BUFFERED_PARTIAL,
              ProcessingMode.NONE}  # fmt: skip


def body_mode(first: ProcessingRequest) -> int:
    """The answer's body mode Envoy says it will use (its first message's protocol_config;
    an Envoy that does not say: STREAMED, as kvgate's Envoy config sets it)."""
    if not first.HasField("protocol_config"):
        return int(ProcessingMode.STREAMED)
    mode = int(first.protocol_config.response_body_mode)
    if mode not in BODY_MODES:
        raise ServerError(
            f"Envoy's response_body_mode {ProcessingMode.BodySendMode.Name(mode)} is not one "
            "kvgate follows: use STREAMED (the body through kvgate) or NONE (headers only)"
        )
    return mode


class Processor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        stream = EnvoyStream(context)
        first = await stream.next()
        if first is None:
            return
        headers = (
            headers_of(first.request_headers.headers)
            if first.WhichOneof("request") == "request_headers" else {}
        )
        path = headers.get(":path", "").partition("?")[0]
        endpoint = ENDPOINTS.get((headers.get(":method", ""), path))
        if endpoint is None:  # not an OpenAI request kvgate decides on
            await stream.answer(headers_reply("request_headers", {}, remove=SYSTEM_OWNED))
            await stream.pass_through()
            return
        client = CIMultiDictProxy(CIMultiDict(
            (name, value) for name, value in headers.items() if not name.startswith(":")
        ))
        info = request_info(client)
        envoy: EnvoyRequest | None = None
        try:
            await stream.answer(headers_reply("request_headers", {}, remove=SYSTEM_OWNED))
            x = Exchange(self.gateway.runtime, info, endpoint, client)
            x.raw = await self.body(stream, first, x.rt.config.server.max_body_bytes)
            sees_body = body_mode(first) != ProcessingMode.NONE
            envoy = EnvoyRequest(stream, client, x.raw, sees_body=sees_body)
            plane = Plane(
                BreakerTransport(envoy, self.gateway.breakers), envoy.deliver,
                retries=False, subset=subset_of(first), sees_body=sees_body,
            )
            await self.gateway.run(x, source_address(first), plane)
        except asyncio.CancelledError:  # Envoy reset the stream: the client left
            if envoy is not None and envoy.ended_by_envoy():  # or, in headers mode, the end
                record(self.gateway, info, "ok", 200)
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                return
            record(self.gateway, info, "ok" if info.delivered else "disconnected", 499)
            raise
        except KvgateError as exc:
            self.refused(info, exc)
            await stream.answer_if_pending(immediate(exc, info.request_id))
        except Exception:
            log.exception("unhandled error processing %s", path)
            error = ServerError("kvgate failed to handle this request; see its logs")
            self.refused(info, error)
            await stream.answer_if_pending(immediate(error, info.request_id))
        else:
            record(self.gateway, info, "disconnected" if info.disconnected else "ok", 200)
        if envoy is not None and envoy.gave_up:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "kvgate gave up on the answer")
        await stream.pass_through()

    async def body(self, stream: EnvoyStream, first: ProcessingRequest, limit: int) -> bytes:
        """The request's whole body, in the one message Envoy buffers it in (its
        `request_body_mode: BUFFERED`); left awaiting its answer, the pick."""
        if first.request_headers.end_of_stream:
            return b""
        message = await stream.next()
        if message is None or message.WhichOneof("request") != "request_body":
            raise ServerError("Envoy sent no request body: kvgate needs request_body_mode BUFFERED")
        if not message.request_body.end_of_stream:
            raise ServerError("Envoy streamed the request body: kvgate needs request_body_mode "
                              "BUFFERED, so that it picks before anything is sent on")
        body = bytes(message.request_body.body)
        if len(body) > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        return body

    def refused(self, info: RequestInfo, error: KvgateError) -> None:
        outcome = "refused" if error.status < 500 else "upstream_error"
        record(self.gateway, info, outcome, error.status, error.refusal_reason)
        self.gateway.metrics.refusals.labels(info.pool, info.tenant, error.refusal_reason).inc()
