"""The Envoy data plane of one request: kvgate's pick goes to Envoy, the answer comes back
through kvgate chunk by chunk (`Plane` of `kvgate.transport.plane`).

    send      answer the request body: the pick (header and `envoy.lb` metadata), the headers
              and body as kvgate sends them on; then wait for the response headers
    deliver   answer the response headers with kvgate's own; read the body as it passes,
              counting tokens and taking the usage (stripped where the client did not ask
              for it), as the proxy's relay does, with the same `Events`

A replica's 5xx is read whole before the client sees it (the body's mode is switched to
buffered for that answer): vLLM's busy 503 and a failure are told apart as in proxy mode, and
the client is answered in OpenAI's shape. Behind Envoy a request is sent once: Envoy holds it,
so the attempts stage does not place it again.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse
from multidict import CIMultiDict

from kvgate.epp.stream import (
    DESTINATION,
    FLAGS,
    LB_NAMESPACE,
    SYSTEM_OWNED,
    EnvoyStream,
    body_reply,
    headers_of,
    headers_reply,
    unchanged,
)
from kvgate.errors import UpstreamError, UpstreamTimeout
from kvgate.idle import IdleTimeout
from kvgate.transport.base import HOP_BY_HOP, Outcome, UpstreamRequest, UpstreamResponse
from kvgate.transport.relay import DONE, Events, judge_whole

# Envoy's response flags that say the replica was never reached, or did not answer in time.
UNREACHED = frozenset({"UF", "UH", "URX", "UO", "NR", "NC"})
TIMED_OUT = frozenset({"UT"})


class EnvoyRequest:
    """One request's side of Envoy: its `send` is the plane's transport, `deliver` its relay.
    `sees_body`: Envoy sends the answer's body through kvgate (its response_body_mode
    STREAMED); else (NONE, headers mode) only the answer's headers and then its end."""

    def __init__(
        self, stream: EnvoyStream, incoming: Mapping[str, str], raw: bytes, *, sees_body: bool
    ) -> None:
        self.stream = stream
        self.sees_body = sees_body
        self.incoming = incoming  # the client's headers, as Envoy has them
        self.raw = raw  # the client's body, as Envoy buffered it
        self.out: list[bytes] | None = None  # what goes on for the body chunk awaiting its answer
        self.chunk = b""  # that chunk, as it came
        self.ended = False  # the answer's last chunk came
        self.gave_up = False  # kvgate stopped following the answer (a timeout): Envoy must end it
        self.answered = False  # the answer's headers went on to the client

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        """Answer the request body with the pick; the answer once its headers came."""
        attempt, replica, t = request.attempt, request.replica, request.timeouts
        deadline = time.monotonic() + t.total_s
        await self.stream.answer(self.pick(request))
        attempt.sent_at = time.monotonic()
        try:
            async with asyncio.timeout(min(t.first_byte_s, t.total_s)):
                message = await self.stream.next()
        except TimeoutError:
            attempt.upstream_failed = attempt.timed_out = True
            raise UpstreamTimeout(
                f"replica {replica.id} did not answer within {t.first_byte_s:g}s"
            ) from None
        if message is None or message.WhichOneof("request") != "response_headers":
            attempt.upstream_failed = True
            raise UpstreamError(f"Envoy ended the exchange before replica {replica.id} answered")
        headers = headers_of(message.response_headers.headers)
        status = int(headers.get(":status", "0") or 0)
        flags = frozenset(headers.get(FLAGS, "").split(","))
        if flags & UNREACHED:
            attempt.upstream_failed = attempt.unreachable = True
            raise UpstreamError(f"replica {replica.id} could not be reached ({','.join(flags)})")
        if flags & TIMED_OUT:
            attempt.upstream_failed = attempt.timed_out = True
            raise UpstreamTimeout(f"replica {replica.id} did not answer in time")
        attempt.status = status
        self.ended = message.response_headers.end_of_stream
        return UpstreamResponse(
            request, status, deadline, read=self.read, readany=self.readany, aclose=self.aclose,
        )

    def pick(self, request: UpstreamRequest) -> ProcessingResponse:
        """The request body's answer: the endpoint, and the request as kvgate sends it on
        (its headers as the proxy would send them; its body where kvgate changed it)."""
        wanted = CIMultiDict(request.headers)
        wanted[DESTINATION] = request.replica.address
        remove = [
            name for name in self.incoming
            if not name.startswith(":") and name not in wanted
            and name not in HOP_BY_HOP and name not in SYSTEM_OWNED
        ]
        body = None
        if request.body != self.raw:
            body = request.body
            wanted["content-length"] = str(len(body))
        return body_reply(
            "request_body", body, set_headers=wanted, remove=remove,
            metadata={LB_NAMESPACE: {DESTINATION: request.replica.address}},
        )

    async def deliver(
        self, answer: UpstreamResponse, headers: Mapping[str, str], client_wants_usage: bool
    ) -> None:
        """Relay `answer` through Envoy with kvgate's response `headers`."""
        outcome = answer.request.attempt
        try:
            if answer.status >= 500:  # read whole before the client sees it: busy or failed
                if not self.ended:
                    await self.stream.answer(
                        headers_reply("response_headers", {}, buffer_body=True)
                    )
                judge_whole(answer, await self.buffered())  # raises; answered with the error
                return
            await self.stream.answer(headers_reply("response_headers", headers, remove=[FLAGS]))
            self.answered = answer.status < 400
            idle = answer.request.timeouts.idle_s
            until = asyncio.get_running_loop().time() + (answer.deadline - time.monotonic())
            if not self.sees_body:  # headers mode: the answer's end is the stream's
                await self.until_closed(until)
                outcome.done = answer.status < 400
                return
            if answer.status >= 400 or not answer.request.stream:
                async with asyncio.timeout_at(until):
                    judge_whole(answer, await self.read())  # a 4xx goes as the replica wrote it
                return
            events = Events(functools.partial(self.relay, outcome), outcome, client_wants_usage)
            async with IdleTimeout(idle, until) as limit:
                await events.pump(self.readany, limit)
            await events.flush()
        except TimeoutError:
            outcome.upstream_failed = self.gave_up = True
        finally:
            await answer.aclose()

    async def until_closed(self, until: float) -> None:
        """Until Envoy ends the exchange (headers mode: the answer goes past kvgate). Envoy
        closes the stream, or resets it (`ended_by_envoy`), once the answer is over or the
        client left: kvgate cannot tell which (Envoy's access log can: flag DC)."""
        async with asyncio.timeout_at(until):
            await self.stream.pass_through()

    def ended_by_envoy(self) -> bool:
        """In headers mode, a reset of the stream once the answer's headers went on is how
        Envoy may end the exchange (gRPC cancels the handler before its context says so):
        the answer's end, not a failure."""
        return not self.sees_body and self.answered

    async def readany(self) -> bytes:
        """The answer's next body chunk (b"" at its end); the one before goes on, as changed."""
        await self.answer_chunk()
        if self.ended:
            return b""
        message = await self.stream.next()
        if message is None:
            self.ended = True
            return b""
        if message.WhichOneof("request") != "response_body":  # trailers: the body is over
            self.ended = True
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

    async def buffered(self) -> bytes:
        """The body Envoy buffered whole, left awaiting its answer (kvgate's error)."""
        if self.ended:
            return b""
        message = await self.stream.next()
        if message is None or message.WhichOneof("request") != "response_body":
            return b""
        return bytes(message.response_body.body)

    async def write(self, data: bytes) -> None:
        """Send `data` on in place of the chunk read last."""
        assert self.out is not None, "no body chunk awaits its answer"
        self.out.append(data)

    async def relay(self, outcome: Outcome, data: bytes) -> None:
        """A stream's events on their way to the client: the last says it has it all."""
        await self.write(data)
        if data.endswith(DONE):
            outcome.done = True

    async def answer_chunk(self) -> None:
        """The body chunk read last goes on, as written (unchanged where it is the same)."""
        if self.out is None:
            return
        out, self.out = b"".join(self.out), None
        await self.stream.answer_if_pending(
            body_reply("response_body", None if out == self.chunk else out)
        )

    async def aclose(self) -> None:
        await self.answer_chunk()
