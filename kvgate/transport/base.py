"""The upstream call as one method, and the values it takes and gives.

    Transport.send(UpstreamRequest) -> UpstreamResponse

`send` returns once the replica's response headers arrived (the body is read by the caller
through the response), or raises a `KvgateError` if the replica never answered: the HTTP
transport (`kvgate.transport.http`) does the call; the breaker (`kvgate.transport.breaker`)
wraps it to judge each attempt. Neither value holds an aiohttp request or response object,
so that the policy stages could forward through another data plane.

Each attempt at a replica has its `Outcome`, the record of what happened on the wire: the
transport fills in when it was sent and how it answered, the relay what it relayed; the
gateway settles and the breaker judges by it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from multidict import CIMultiDict

from kvgate.config import TimeoutsConfig
from kvgate.errors import ReplicaBusy, ServerError, Unreachable
from kvgate.fleet.replicas import Replica
from kvgate.request.parsed import MODEL_REWRITE
from kvgate.tenants import FAIRNESS_ID, OBJECTIVE

E = TypeVar("E", bound=ServerError)

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
        "Accept-Encoding", "Content-Encoding",
    )
)
# vLLM's header pinning a request to one of a replica's data-parallel ranks: kvgate sets it
# where one rank caches the prompt (`KvEvents.rank_for`), and a client's is never sent on.
DP_RANK = "x-data-parallel-rank"
# Client headers that only concern kvgate and are never sent on (the Inference Extension's
# request control headers among them, as its picker strips them).
PRIVATE = frozenset({"x-tenant-id", OBJECTIVE, FAIRNESS_ID, MODEL_REWRITE, DP_RANK})


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class Outcome:
    """What happened on the wire in one attempt, for settling, the breaker and metrics."""

    status: int = 0
    usage: Usage | None = None
    streamed_tokens: int = 0  # content chunks relayed (≈ tokens; vLLM sends one per token)
    replica: Replica | None = None  # where it went
    rank: int | None = None  # the replica's data-parallel engine it was pinned to, if any
    sent_at: float | None = None  # when the request went to the replica
    decode_start: float | None = None  # the replica's decode clock then (tokens per sequence)
    ended_at: float | None = None  # when kvgate was done with the replica's connection
    first_token_at: float | None = None
    done: bool = False  # the client was sent the whole answer ([DONE], or the full body)
    client_disconnected: bool = False
    # how the replica's end failed (`kvgate.errors`: Unreachable, NoHeadersInTime, StreamBroke,
    # BadAnswer, LateAnswer), or vLLM's queue limits refusing it (ReplicaBusy: not a failure)
    failure: ServerError | None = None
    # the answer's body passed through kvgate (False behind Envoy in headers mode: a stream's
    # tokens are then the replica's decode clock's, as for a whole answer)
    body_seen: bool = True

    def fail(self, error: E) -> E:
        """Record how the attempt failed (the first failure stands), and return it to raise."""
        if self.failure is None:
            self.failure = error
        return error

    @property
    def upstream_failed(self) -> bool:
        return self.failure is not None and not isinstance(self.failure, ReplicaBusy)

    @property
    def unreachable(self) -> bool:
        """The request never got to the replica (the connection failed)."""
        return isinstance(self.failure, Unreachable)

    @property
    def busy(self) -> str | None:
        """vLLM's reason for refusing it (its queue limits), if it did."""
        return self.failure.reason if isinstance(self.failure, ReplicaBusy) else None

    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage else self.streamed_tokens

    def counted(self, stream: bool) -> bool:
        """Its output is the chunks kvgate counted: a stream whose body kvgate saw."""
        return stream and self.body_seen

    def caused_no_work(self, stream: bool) -> bool:
        """The replica processed nothing the tenant caused: the request was never sent, never
        reached it (the connection failed), was refused by it, or was a stream that never
        began (vLLM sends a stream's headers at once, so it was not working on it)."""
        return (
            self.sent_at is None
            or self.unreachable
            or self.status >= 400
            or (self.upstream_failed and self.status == 0 and stream)
        )


@dataclass(slots=True)
class UpstreamRequest:
    """One attempt's request to one replica. `attempt` is filled in as the attempt goes, so
    that a caller cancelled midway still knows what was sent and streamed."""

    replica: Replica
    path: str  # the endpoint's, e.g. /v1/chat/completions
    body: bytes  # the client's bytes, or its body as kvgate edited it
    headers: Mapping[str, str]
    timeouts: TimeoutsConfig
    stream: bool
    holder: str  # the request's key: whose verdict a half-open circuit waits for
    attempt: Outcome = field(default_factory=Outcome)


@dataclass(slots=True)
class UpstreamResponse:
    """The replica's answer, its headers arrived. Its body is read with `read` (whole) or
    `readany` (the next chunk; b"" at its end); `aclose` gives the connection back and is
    called exactly once, when the caller is done with the body, on every ending."""

    request: UpstreamRequest
    status: int
    deadline: float  # time.monotonic() by which the whole answer must be in (timeouts.total_s)
    read: Callable[[], Awaitable[bytes]]
    readany: Callable[[], Awaitable[bytes]]
    aclose: Callable[[], Awaitable[None]]


class Transport(Protocol):
    """Sends one request to its replica. Returns once the response headers arrived; raises
    `UpstreamError` / `UpstreamTimeout` (with `request.attempt` saying which: unreachable,
    timed out) if they never did. Called once per attempt, on the event loop."""

    async def send(self, request: UpstreamRequest) -> UpstreamResponse: ...


def upstream_headers(
    incoming: Mapping[str, str], request_id: str, replica: Replica, *, drop_authorization: bool,
    rank: int | None = None,
) -> CIMultiDict[str]:
    """The client's headers as sent on: no hop-by-hop or kvgate-only ones, the replica's own
    API key instead of the client's (or no Authorization where kvgate authenticates), and
    the data-parallel rank kvgate pinned it to, if any."""
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
    if rank is not None:
        headers[DP_RANK] = str(rank)
    return headers
