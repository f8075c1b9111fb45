"""What one attempt at a replica says of it, and whether the request may go elsewhere: pure
functions of the attempt's `Outcome`, for the breaker (`kvgate.transport.breaker`) and the
attempts stage (`kvgate.transport.attempts`).
"""

from __future__ import annotations

from kvgate.config import RetryConfig
from kvgate.errors import (
    KvgateError,
    NoHeadersInTime,
    ReplicaBusy,
    Unreachable,
    UpstreamError,
    UpstreamTimeout,
)
from kvgate.transport.base import Outcome


def replica_failed(outcome: Outcome, stream: bool) -> bool | None:
    """True if the replica failed (unreachable, 5xx, a stream broken or silent past a
    timeout), False if it answered (2xx or 3xx), None if the attempt says nothing of it: the
    client left first, a 4xx (the client's problem, or a replica that answers but serves
    nothing useful: not proof of health), vLLM's own queue limits refusing it (a busy replica
    is not a broken one: `kvgate.admission.backpressure`), or a whole answer that took longer than
    first_byte_s (vLLM sends a non-streamed answer's headers only when it is done: long is not
    broken)."""
    failure = outcome.failure
    if isinstance(failure, ReplicaBusy):
        return None
    if isinstance(failure, NoHeadersInTime):
        return stream or outcome.status != 0
    if failure is not None:
        return True
    if 0 < outcome.status < 400:
        return False
    return None


def retry_reason(exc: KvgateError, outcome: Outcome, retry: RetryConfig) -> str | None:
    """Why the request may go to another replica, or None. Only failures before any byte
    reached the client (the relay raises those; later ones end the stream in-band) and before
    the replica could have done the work: it was unreachable, answered 5xx, or — when
    retry.on_timeout — sent no headers within first_byte_s."""
    if outcome.sent_at is None or not isinstance(exc, UpstreamError | UpstreamTimeout):
        return None
    if isinstance(exc, Unreachable):
        return "unreachable"
    if outcome.status >= 500:
        return "upstream_error"
    if outcome.status == 0:
        if isinstance(exc, UpstreamTimeout):
            return "timeout" if retry.on_timeout else None
        return "upstream_error"  # the connection broke before the headers
    return None
