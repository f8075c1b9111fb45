"""The Envoy data plane of one request: kvgate's pick goes to Envoy, the answer comes back
through kvgate chunk by chunk (`Plane` of `kvgate.transport.plane`).

    send      answer the request body: the pick (header and `envoy.lb` metadata), the headers
              and body as kvgate sends them on; then wait for the response headers
    deliver   answer the response headers with kvgate's own; read the body as it passes,
              counting tokens and taking the usage (stripped where the client did not ask
              for it), as the proxy's relay does, with the same `Events`

An answer of 400 or more is read whole before the client sees it (the body's mode switched to
buffered for that answer): vLLM's busy 503 and a failure are told apart as in proxy mode, and
the client is answered in OpenAI's shape. Behind Envoy a request is sent once: Envoy holds it,
so the attempts stage does not place it again. Envoy enforces the upstream timeouts (its
route's, written from kvgate's `timeouts`: a 504 it answers itself is read by its flags);
kvgate's own waits are a backstop a few seconds longer, after which it ends the exchange.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import time
from collections.abc import Mapping

import orjson
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse
from multidict import CIMultiDict, CIMultiDictProxy

from kvgate.epp.stream import (
    DESTINATION,
    FLAGS,
    LB_NAMESPACE,
    SERVED,
    SYSTEM_OWNED,
    EnvoyStream,
    body_reply,
    headers_of,
    headers_reply,
    metadata_struct,
    served_of,
    unchanged,
)
from kvgate.errors import BadAnswer, LateAnswer, NoHeadersInTime, StreamBroke, Unreachable
from kvgate.transport.base import Outcome, UpstreamRequest, UpstreamResponse
from kvgate.transport.idle import IdleTimeout
from kvgate.transport.relay import Events, judge_whole, wrote

# Envoy's response flags that say the replica was never reached, or did not answer in time.
UNREACHED = frozenset({"UF", "UH", "URX", "UO", "NR", "NC"})
TIMED_OUT = frozenset({"UT", "SI"})  # upstream request timeout, stream idle timeout
# How much longer than Envoy's own timeouts kvgate waits before it ends the exchange itself.
BACKSTOP_S = 5.0
# Headers Envoy keeps for the connections it owns (never removed by kvgate; the rest of the
# client's headers that the proxy would not send on are removed, hop-by-hop ones included).
ENVOY_OWNED = frozenset({"host", "content-length", "transfer-encoding"})


class Phase(enum.Enum):
    """Where the answer stands between kvgate and Envoy; what the stream does when it ends
    (`kvgate.epp.processor`): on a reset, whether the request path may finish its books or
    is cancelled; at its end, whether kvgate must abort the stream for Envoy to end it."""

    AWAITED = "awaited"  # no pick yet
    PICKED = "picked"  # the pick went to Envoy: the request and its answer are under way
    DELIVERED = "delivered"  # the whole answer went on (or kvgate's own): a reset is a close
    ABANDONED = "abandoned"  # kvgate stopped following an answer under way: Envoy must end it
    # both, in either order: headers mode's answer passed, then its end never came in time;
    # or kvgate answered with an error after it stopped following
    DELIVERED_ABANDONED = "delivered, abandoned"

    @property
    def delivered(self) -> bool:
        return self in (Phase.DELIVERED, Phase.DELIVERED_ABANDONED)

    @property
    def abandoned(self) -> bool:
        return self in (Phase.ABANDONED, Phase.DELIVERED_ABANDONED)


class EnvoyRequest:
    """One request's side of Envoy: its `send` is the plane's transport, `deliver` its relay.
    Made when the request's headers came; its body and body mode are set once they are read."""

    def __init__(self, stream: EnvoyStream, incoming: CIMultiDictProxy[str]) -> None:
        self.stream = stream
        self.incoming = incoming  # the client's headers, as Envoy has them
        self.raw = b""  # the client's body, as Envoy buffered it
        self.bodyless = False  # the request ended with its headers
        # Envoy sends the answer's body through kvgate (its response_body_mode STREAMED); else
        # (NONE, headers mode) only the answer's headers and then its end
        self.sees_body = True
        self.out: list[bytes] | None = None  # what goes on for the body chunk awaiting its answer
        self.chunk = b""  # that chunk, as it came
        self.ended = False  # the answer's last chunk came
        self.phase = Phase.AWAITED

    def deliver_done(self) -> None:
        """The whole answer went on (or kvgate's own): Envoy's to deliver and close."""
        self.phase = Phase.DELIVERED_ABANDONED if self.phase.abandoned else Phase.DELIVERED

    def abandon(self) -> None:
        """kvgate stops following the answer: Envoy must end it."""
        self.phase = Phase.DELIVERED_ABANDONED if self.phase.delivered else Phase.ABANDONED

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        """Answer the request body with the pick; the answer once its headers came."""
        attempt, replica, t = request.attempt, request.replica, request.timeouts
        deadline = time.monotonic() + t.total_s
        await self.send_pick(request)
        self.phase = Phase.PICKED
        attempt.sent_at = time.monotonic()
        try:
            async with asyncio.timeout(t.total_s + BACKSTOP_S):
                message = await self.stream.next()
        except TimeoutError:
            self.abandon()
            raise attempt.fail(
                NoHeadersInTime(f"Envoy sent no answer from replica {replica.id}")
            ) from None
        if message is None or message.WhichOneof("request") != "response_headers":
            raise attempt.fail(
                StreamBroke(f"Envoy ended the exchange before replica {replica.id} answered")
            )
        headers = headers_of(message.response_headers.headers)
        status = int(headers.get(":status", "0") or 0)
        flags = frozenset(headers.get(FLAGS, "").split(","))
        if flags & UNREACHED:
            raise attempt.fail(
                Unreachable(f"replica {replica.id} could not be reached ({','.join(flags)})")
            )
        if flags & TIMED_OUT:
            raise attempt.fail(
                NoHeadersInTime(f"replica {replica.id} did not answer within Envoy's timeout")
            )
        served = served_of(message) or headers.get(SERVED)
        if served and served != replica.address:
            # Envoy's cluster lacks the pick (override_host fell back): booked here, run there
            raise attempt.fail(BadAnswer(
                f"Envoy sent the request to {served}, not to the replica kvgate admitted it on "
                f"({replica.address}): the pool's cluster must list the same addresses"
            ))
        attempt.status = status
        self.ended = message.response_headers.end_of_stream
        return UpstreamResponse(
            request, status, deadline, read=self.read, readany=self.readany, aclose=self.aclose,
        )

    async def send_pick(self, request: UpstreamRequest) -> None:
        """The pick, as the answer to the request's body; in full duplex, as the answer to its
        headers, then the body itself (Envoy keeps no copy) and its trailers' answer."""
        stream = self.stream
        if "request_body" not in stream.duplex:
            await stream.answer(self.pick(request))
            return
        await stream.answer(self.pick(request, "request_headers"))
        if not self.bodyless:
            trailers = stream.trailers
            await stream.send_streamed("request_body", request.body, trailers is None)
            if trailers is not None:
                await stream.send(unchanged(trailers))

    def pick(self, request: UpstreamRequest, phase: str = "request_body") -> ProcessingResponse:
        """The pick, as the answer to `phase`: the endpoint, and the request as kvgate sends it
        on (its headers as the proxy would send them; its body where kvgate changed it, or in
        full duplex not at all: its headers' answer cannot carry it)."""
        wanted = CIMultiDict(request.headers)
        for name in SYSTEM_OWNED:  # the picker's and the data plane's, never the client's
            wanted.popall(name, None)
        wanted[DESTINATION] = request.replica.address
        remove = [  # the picker's own headers included, whatever the client sent
            name for name in dict.fromkeys(self.incoming)
            if not name.startswith(":") and name not in wanted and name not in ENVOY_OWNED
        ]
        metadata = {LB_NAMESPACE: {DESTINATION: request.replica.address}}
        if phase == "request_headers":  # Envoy drops a content-length here, and sends it chunked
            wanted.popall("content-length", None)
            reply = headers_reply(phase, self.changes(wanted), remove)
            reply.dynamic_metadata.CopyFrom(metadata_struct(metadata))
            return reply
        body = None
        if request.body != self.raw:
            body = request.body
            wanted["content-length"] = str(len(body))
        return body_reply(
            phase, body, set_headers=self.changes(wanted), remove=remove, metadata=metadata
        )

    def changes(self, wanted: CIMultiDict[str]) -> dict[str, str]:
        """The headers in `wanted` that Envoy does not hold as they are: only those are set
        (each costs kvgate a protobuf message and Envoy a header mutation)."""
        incoming = self.incoming
        return {name: value for name, value in wanted.items()
                if incoming.getall(name, None) != wanted.getall(name)}  # fmt: skip

    async def deliver(
        self, answer: UpstreamResponse, headers: Mapping[str, str], client_wants_usage: bool
    ) -> None:
        """Relay `answer` through Envoy with kvgate's response `headers`."""
        outcome = answer.request.attempt
        idle = answer.request.timeouts.idle_s + BACKSTOP_S
        until = asyncio.get_running_loop().time() + (answer.deadline - time.monotonic())
        until += BACKSTOP_S
        try:
            if answer.status >= 400:
                await self.error(answer, headers)
            elif not self.sees_body:  # headers mode: the answer's end is the stream's
                await self.answer_headers(headers)
                self.deliver_done()  # what is left goes past kvgate: Envoy's close or reset
                async with asyncio.timeout_at(until):
                    await self.stream.pass_through()
                outcome.done = True
            elif not answer.request.stream:
                await self.answer_headers(headers)
                async with asyncio.timeout_at(until):
                    judge_whole(answer, await self.read())
            else:
                await self.answer_headers(headers)
                events = Events(functools.partial(self.relay, outcome), outcome, client_wants_usage)
                async with IdleTimeout(idle, until) as limit:
                    await events.pump(self.readany, limit)
                await events.flush()
        except TimeoutError:  # Envoy's own timeouts did not end it: kvgate stops following
            self.abandon()
            outcome.fail(LateAnswer(f"replica {answer.request.replica.id}'s answer outlived "
                                    "Envoy's timeouts"))
        finally:
            await answer.aclose()

    async def answer_headers(self, headers: Mapping[str, str], *, buffer: bool = False) -> None:
        """The answer's headers go on with kvgate's own, less those the data plane added for
        kvgate alone (where it sent the request, how that went): the client never sees them."""
        await self.stream.answer(
            headers_reply("response_headers", headers, remove=[FLAGS, SERVED], buffer_body=buffer)
        )

    async def error(self, answer: UpstreamResponse, headers: Mapping[str, str]) -> None:
        """An answer of 400 or more, read whole first: a 5xx raises (busy or failed; the body
        left awaiting kvgate's error as its answer), a 4xx goes on in OpenAI's shape."""
        if self.ended:  # no body: the headers await their answer
            judge_whole(answer, b"")
            await self.answer_headers(headers)
            self.deliver_done()
            return
        if "response_body" in self.stream.duplex:  # its chunks come while its headers wait
            error = judge_whole(answer, await self.whole_body(answer))
            body = orjson.dumps(error)
            await self.answer_headers(headers)
            await self.stream.send_streamed("response_body", body, True)
            self.ended = True
            self.deliver_done()
            return
        await self.answer_headers(headers, buffer=True)
        message = await self.stream.next()
        if message is None or message.WhichOneof("request") != "response_body":
            raise StreamBroke(f"Envoy sent no body for replica {answer.request.replica.id}'s "
                              f"{answer.status}")  # its status judges the replica
        error = judge_whole(answer, bytes(message.response_body.body))
        body = orjson.dumps(error)
        await self.stream.answer(
            body_reply("response_body", body, set_headers={"content-length": str(len(body))})
        )
        self.ended = True
        self.deliver_done()

    async def whole_body(self, answer: UpstreamResponse) -> bytes:
        """Full duplex: the answer's body, every chunk up to its end (its trailers, if it has
        them, end it too; they go nowhere: kvgate answers in their place)."""
        parts: list[bytes] = []
        while (message := await self.stream.read_more()) is not None:
            if message.WhichOneof("request") != "response_body":
                return b"".join(parts)
            parts.append(message.response_body.body)
            if message.response_body.end_of_stream:
                return b"".join(parts)
        raise StreamBroke(f"Envoy ended the exchange before replica "
                          f"{answer.request.replica.id}'s {answer.status} was whole")

    async def readany(self) -> bytes:
        """The answer's next body chunk (b"" at its end); the one before goes on, as changed.
        The last stays awaiting its answer (a flush may still add to it) until `aclose`."""
        if self.ended:
            return b""
        await self.answer_chunk()
        message = await self.stream.next()
        if message is None:
            self.ended = True
            return b""
        if message.WhichOneof("request") != "response_body":  # trailers: the body is over
            self.ended = True
            if "response_body" in self.stream.duplex:  # what is flushed goes before them
                self.chunk, self.out = b"", []
                return b""
            await self.stream.answer(unchanged(message))
            return b""
        self.chunk, self.out = message.response_body.body, []
        self.ended = message.response_body.end_of_stream
        return self.chunk

    async def read(self) -> bytes:
        """The whole body, each chunk going on as it came."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
            await self.write(chunk)
        return b"".join(parts)

    async def write(self, data: bytes) -> None:
        """Send `data` on in place of the chunk read last."""
        assert self.out is not None, "no body chunk awaits its answer"
        self.out.append(data)

    async def relay(self, outcome: Outcome, data: bytes) -> None:
        """A stream's events on their way to the client."""
        await self.write(data)
        wrote(outcome, data)

    async def answer_chunk(self) -> None:
        """The body chunk read last goes on, as written (unchanged where it is the same)."""
        if self.out is None:
            return
        out, self.out = b"".join(self.out), None
        stream = self.stream
        if "response_body" not in stream.duplex:
            await stream.answer_if_pending(
                body_reply("response_body", None if out == self.chunk else out)
            )
            return
        pending = stream.pending
        if pending is None or stream.context.done():
            return
        if pending.WhichOneof("request") == "response_trailers":  # the body is over: then they go
            if out:
                await stream.send_streamed("response_body", out, False)
            await stream.answer(unchanged(pending))
            return
        await stream.answer_streamed("response_body", out, pending.response_body.end_of_stream)

    async def aclose(self) -> None:
        """The last chunk goes on: the whole answer is then Envoy's to deliver."""
        if self.ended and self.out is not None and self.phase is Phase.PICKED:
            self.deliver_done()
        await self.answer_chunk()
