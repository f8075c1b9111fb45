"""One HTTP request's external-processing stream with Envoy: its messages in order, each
answered once, and the messages kvgate builds.

Envoy's ext_proc filter opens a gRPC stream per HTTP request and sends, as its processing mode
says, the request headers, the request body, the response headers and the response body's
chunks; it waits for the answer to each before it goes on. `EnvoyStream` keeps the message
awaiting its answer (`pending`), so that whatever ends the request path knows whether it can
still answer with an `ImmediateResponse` (an error in OpenAI's shape) and answers it exactly
once. One task reads the stream into a queue: a wait that times out never cancels a gRPC
read (grpc.aio would take the next read's failure for the stream's end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping

import grpc
import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from kvgate.errors import KvgateError

log = logging.getLogger(__name__)

# The Gateway API Inference Extension's endpoint picker protocol: the pick, as a header and as
# dynamic metadata in Envoy's load balancer namespace; the subset the data plane allows.
DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
# Envoy's response flags (%RESPONSE_FLAGS%) for the answer, added by kvgate's Envoy config:
# UF (connection failure), UH (no healthy host), URX (retries exhausted), UT (timeout).
FLAGS = "x-kvgate-envoy-flags"
# Headers only the data plane or the picker may set: never taken from the client.
SYSTEM_OWNED = (DESTINATION, SUBSET, SERVED, "x-gateway-destination-endpoint-fallback")
# In full duplex, a body goes back in chunks of at most this (some gateways cap each at 64 KiB).
CHUNK_BYTES = 62_000


class EnvoyStream:
    """`pending`: the message awaiting its answer. A body Envoy sends in full duplex (its
    phase in `duplex`) comes without waiting for any answer, and goes on only as kvgate sends
    it back (`answer_streamed`); each chunk is still answered before the next is read, but a
    request's headers, whose answer is the pick, wait while the body is read (`read_more`)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.pending: ProcessingRequest | None = None  # the message awaiting its answer
        self.messages: asyncio.Queue[ProcessingRequest | BaseException | None] = asyncio.Queue()
        self.reader: asyncio.Task[None] | None = None
        self.closed = False  # Envoy closed its side
        self.duplex: frozenset[str] = frozenset()  # the body phases in FULL_DUPLEX_STREAMED
        # full duplex: the request's trailers, which ended its body; answered after the body
        self.trailers: ProcessingRequest | None = None

    async def next(self) -> ProcessingRequest | None:
        """Envoy's next message (the one before it answered); None once Envoy closed its side."""
        assert self.pending is None, "answer a message before reading the next"
        message = await self.read_more()
        self.pending = message
        return message

    async def read_more(self) -> ProcessingRequest | None:
        """Envoy's next message, owing it no answer of its own (full duplex: what answers it
        is streamed later); None once Envoy closed its side."""
        if self.closed:
            return None
        if self.reader is None:
            self.reader = asyncio.create_task(self._read())
        message = await self.messages.get()
        if isinstance(message, BaseException):
            raise message
        if message is None:
            self.closed = True
            return None
        return message

    async def _read(self) -> None:
        """Every message into the queue, then how the stream ended: None (closed, or this
        reader stopped), or the error that ended it."""
        end: BaseException | None = None
        try:
            while (message := await self.context.read()) is not grpc.aio.EOF:
                self.messages.put_nowait(message)
        except Exception as exc:  # the RPC failed or was reset
            end = exc
        finally:
            self.messages.put_nowait(end)

    async def close(self) -> None:
        """The exchange is over: stop reading."""
        if self.reader is not None and not self.reader.done():
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader

    async def answer(self, response: ProcessingResponse) -> None:
        """Answer the pending message."""
        assert self.pending is not None, "no message awaits an answer"
        self.pending = None
        await self.context.write(response)

    async def send(self, response: ProcessingResponse) -> None:
        """A message of its own: in full duplex, what answers no message in particular."""
        await self.context.write(response)

    async def send_streamed(self, phase: str, body: bytes, end_of_stream: bool) -> None:
        """Full duplex: `body` sent back of kvgate's own accord, in as many chunks as it takes,
        the last one ending the body where `end_of_stream`."""
        for reply in streamed_replies(phase, body, end_of_stream):
            await self.send(reply)

    async def answer_streamed(self, phase: str, body: bytes, end_of_stream: bool) -> None:
        """Full duplex: answer the pending body chunk with `body`, in as many chunks as it
        takes, the last one ending the body where `end_of_stream`."""
        first, *rest = streamed_replies(phase, body, end_of_stream)
        await self.answer(first)
        for reply in rest:
            await self.send(reply)

    async def answer_if_pending(self, response: ProcessingResponse) -> bool:
        """Answer the pending message, if any, unless the stream is over (Envoy reset it);
        whether it was answered."""
        if self.pending is None or self.context.done():
            return False
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, ConnectionError):
            await self.answer(response)
            return True
        return False

    async def pass_through(self) -> None:
        """Answer everything Envoy still sends with "go on, unchanged", until it closes."""
        while (message := await self.next()) is not None:
            await self.answer(unchanged(message, self.duplex))


def header_pairs(headers: HeaderMap) -> list[tuple[str, str]]:
    """Envoy's header map as (lower-case name, value) pairs, repeated names kept in order."""
    return [
        (h.key.lower(), h.raw_value.decode("latin-1") if h.raw_value else h.value)
        for h in headers.headers
    ]


def headers_of(headers: HeaderMap) -> dict[str, str]:
    """Envoy's header map as a dict: a name that repeats keeps its first value, as aiohttp's
    `headers.get` reads a client's duplicated header."""
    out: dict[str, str] = {}
    for name, value in header_pairs(headers):
        out.setdefault(name, value)
    return out


def unchanged(message: ProcessingRequest, duplex: frozenset[str] = frozenset()) -> ProcessingResponse:
    """The answer that lets `message` go on as it is (a body chunk in a `duplex` phase goes
    on only as kvgate sends it back: Envoy keeps no copy)."""
    phase = message.WhichOneof("request")
    if phase in ("request_headers", "response_headers"):
        return ProcessingResponse(**{phase: HeadersResponse()})
    if phase in ("request_body", "response_body"):
        if phase in duplex:
            chunk = getattr(message, phase)
            return streamed_reply(phase, chunk.body, chunk.end_of_stream)
        return ProcessingResponse(**{phase: BodyResponse()})
    return ProcessingResponse(**{phase: TrailersResponse()})


def streamed_reply(phase: str, chunk: bytes, end_of_stream: bool) -> ProcessingResponse:
    """One chunk of a body sent back in full duplex."""
    mutation = BodyMutation(streamed_response=StreamedBodyResponse(
        body=chunk, end_of_stream=end_of_stream,
    ))
    return ProcessingResponse(**{phase: BodyResponse(response=CommonResponse(
        body_mutation=mutation,
    ))})


def streamed_replies(phase: str, body: bytes, end_of_stream: bool) -> list[ProcessingResponse]:
    """`body` sent back in full duplex: chunks of at most CHUNK_BYTES (one, empty, for an
    empty body), the last ending the body where `end_of_stream`."""
    chunks = [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    last = len(chunks) - 1
    return [streamed_reply(phase, c, end_of_stream and i == last) for i, c in enumerate(chunks)]


def header_options(headers: Mapping[str, str]) -> list[HeaderValueOption]:
    return [
        HeaderValueOption(
            header=HeaderValue(key=name.lower(), raw_value=value.encode("latin-1")),
            append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for name, value in headers.items()
    ]


def headers_reply(
    phase: str, set_headers: Mapping[str, str], remove: Iterable[str] = (),
    *, buffer_body: bool = False,
) -> ProcessingResponse:
    """Go on with these header changes; `buffer_body`: send the rest of the body whole
    (Envoy's `allow_mode_override`), so that kvgate reads it before the client does."""
    mutation = HeaderMutation(set_headers=header_options(set_headers), remove_headers=remove)
    response = ProcessingResponse(**{
        phase: HeadersResponse(response=CommonResponse(header_mutation=mutation)),
    })
    if buffer_body:
        response.mode_override.CopyFrom(ProcessingMode(response_body_mode=ProcessingMode.BUFFERED))
    return response


def body_reply(
    phase: str, body: bytes | None = None, set_headers: Mapping[str, str] | None = None,
    remove: Iterable[str] = (), metadata: Mapping[str, Mapping[str, str]] | None = None,
) -> ProcessingResponse:
    """Go on with this body chunk replaced by `body` (None: unchanged), these header changes
    (a request body's answer may still change the request's headers), and this dynamic
    metadata (namespace -> key -> value)."""
    common = CommonResponse()
    if set_headers or remove:
        common.header_mutation.CopyFrom(HeaderMutation(
            set_headers=header_options(set_headers or {}), remove_headers=remove,
        ))
    if body is not None:
        common.body_mutation.CopyFrom(
            BodyMutation(body=body) if body else BodyMutation(clear_body=True)
        )
    response = ProcessingResponse(**{phase: BodyResponse(response=common)})
    if metadata:
        response.dynamic_metadata.CopyFrom(metadata_struct(metadata))
    return response


def metadata_struct(metadata: Mapping[str, Mapping[str, str]]) -> Struct:
    """Dynamic metadata for Envoy: namespace -> key -> value."""
    struct = Struct()
    for namespace, values in metadata.items():
        struct.fields[namespace].struct_value.update(dict(values))
    return struct


def immediate(error: KvgateError, request_id: str) -> ProcessingResponse:
    """Envoy answers the client with `error` in OpenAI's shape, and sends nothing on."""
    headers = {**error.headers, "x-request-id": request_id}
    headers.pop("Connection", None)  # Envoy owns the client's connection
    return immediate_json(error.status, error.body(), headers, f"kvgate_{error.refusal_reason}")


def immediate_json(
    status: int, body: object, headers: Mapping[str, str], details: str
) -> ProcessingResponse:
    """Envoy answers the client with this JSON body itself."""
    return ProcessingResponse(immediate_response=ImmediateResponse(
        status=HttpStatus(code=status),
        headers=HeaderMutation(set_headers=header_options(
            {**headers, "content-type": "application/json"}
        )),
        body=orjson.dumps(body),
        details=details,
    ))


def served_of(message: ProcessingRequest) -> str | None:
    """The endpoint (host:port) the data plane sent the request to, where it says: in the
    `envoy.lb` metadata, as the protocol has it."""
    namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if namespace is None or SERVED not in namespace.fields:
        return None
    return namespace.fields[SERVED].string_value or None


def subset_of(message: ProcessingRequest) -> frozenset[str] | None:
    """The endpoints (host:port) the data plane allows for this request, if it says."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    if value.WhichOneof("kind") != "list_value":
        return frozenset()
    return frozenset(v.string_value for v in value.list_value.values if v.string_value)


def source_address(message: ProcessingRequest) -> str | None:
    """The client's address, from the `source.address` attribute Envoy sends (as `ip:port`)."""
    for attributes in message.attributes.values():
        value = attributes.fields.get("source.address")
        if value is not None and value.string_value:
            address = str(value.string_value)
            host, _, _port = address.rpartition(":")
            return host.strip("[]") or address
    return None
