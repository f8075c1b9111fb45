"""Backpressure from a healthy replica: vLLM refusing work itself because its queue is long.

vLLM 0.33 with `--max-num-queued-reqs` or `--max-num-queued-tokens` answers a request it will
not queue with 503 and `{"error": {"message": ..., "type": "Service Unavailable", "param":
null, "code": 503}}` (a `GracefulHTTPError`: the type is HTTPStatus(503)'s phrase), and counts
`vllm:admission_rejections{reason}`. That says the replica is busy, not broken: the request
goes elsewhere, or back to kvgate's queue, and the replica's circuit breaker never hears of
it. Any other 503 (an HTML page from a proxy, a body of another shape or type) is a failure
as before. The figure `vllm:admission_rejections_total` steers the overcommit controller
(`kvgate.admission.overcommit`); this module decides where the next requests may go.

`Backpressure` keeps, per replica, how many slots this instance holds there and, after a
refusal, the count it held then (the refused request's own excluded): the replica takes no new
request from this instance while it holds that many or more, until `backoff_s` after the
refusal. So each of our requests that ends there lets one waiting request try, not the whole
queue at once; the lapse covers what kvgate cannot count (other instances, other clients).
Per instance, like the circuits; mutated on the event loop only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

# vLLM's `reason` labels (ADMISSION_REASONS), told apart by the message of each error.
MAX_NUM_QUEUED_REQS = "max_num_queued_reqs"
MAX_NUM_QUEUED_TOKENS = "max_num_queued_tokens"
UNKNOWN = "unknown"  # vLLM's overload type and shape, but neither message: a newer wording
_MESSAGES = {
    "prefill token backlog": MAX_NUM_QUEUED_TOKENS,  # MaxQueuedTokensError
    "currently busy": MAX_NUM_QUEUED_REQS,  # QueueOverflowError
}
VLLM_OVERLOAD_TYPE = "Service Unavailable"


def overload_reason(status: int, raw: bytes) -> str | None:
    """vLLM's reason if this answer is its queue limits refusing the request, else None."""
    if status != 503:
        return None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or error.get("type") != VLLM_OVERLOAD_TYPE:
        return None
    if error.get("code") != 503:
        return None
    message = str(error.get("message") or "")
    return next((reason for words, reason in _MESSAGES.items() if words in message), UNKNOWN)


@dataclass(slots=True)
class _Replica:
    held: int = 0  # this instance's slots there now
    full_at: int = 0  # slots held when it last refused, the refused request's own excluded
    until: float = -math.inf  # when that refusal stops counting


class Backpressure:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._replicas: dict[str, _Replica] = {}

    def placed(self, replica_id: str) -> None:
        """A slot was taken there."""
        self._replicas.setdefault(replica_id, _Replica()).held += 1

    def released(self, replica_id: str) -> None:
        """A slot taken there was given back."""
        state = self._replicas.get(replica_id)
        if state is not None and state.held > 0:
            state.held -= 1

    def refused(self, replica_id: str, backoff_s: float) -> None:
        """The replica refused a request as busy; called while that request holds its slot."""
        state = self._replicas.setdefault(replica_id, _Replica())
        state.full_at = max(0, state.held - 1)
        state.until = self.clock() + backoff_s

    def busy(self, replica_id: str) -> bool:
        """Takes no new request from this instance now."""
        state = self._replicas.get(replica_id)
        if state is None or self.clock() >= state.until:
            return False
        return state.held >= state.full_at

    def lapses_in(self, replica_id: str) -> float:
        """Seconds until the last refusal stops counting (0: it already has)."""
        state = self._replicas.get(replica_id)
        return 0.0 if state is None else max(0.0, state.until - self.clock())

    def forget(self, keep: set[str]) -> None:
        """Drop replicas no longer in the fleet that hold nothing here."""
        for replica_id in list(self._replicas):
            if replica_id not in keep and not self._replicas[replica_id].held:
                del self._replicas[replica_id]
