"""vLLM's overload answer told apart from a replica's failure, and the busy mark it leaves:
a replica takes no more from this instance than it held when it refused, until one of those
ends or the backoff lapses."""

from __future__ import annotations

import orjson
import pytest

from kvgate.admission.backpressure import Backpressure, overload_reason
from kvgate.errors import BadAnswer, ReplicaBusy
from kvgate.sim.admission import MESSAGES
from kvgate.transport.base import Outcome
from kvgate.transport.failover import replica_failed


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def vllm_error(message: str, error_type: str = "Service Unavailable", code: int = 503) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    )


@pytest.mark.parametrize("reason", ["max_num_queued_reqs", "max_num_queued_tokens"])
def test_vllms_queue_limit_answers_are_busy_with_vllms_reason(reason: str) -> None:
    assert overload_reason(503, vllm_error(MESSAGES[reason])) == reason


def test_vllms_overload_type_in_another_wording_is_still_busy() -> None:
    assert overload_reason(503, vllm_error("Too many requests queued.")) == "unknown"


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (500, vllm_error(MESSAGES["max_num_queued_reqs"])),  # not a 503
        (503, b"<html>503 Service Temporarily Unavailable</html>"),  # a proxy's page
        (503, b""),
        (503, b'{"error": "The model is currently scaling. Please try again later."}'),
        (503, vllm_error("Request failed; please retry", "ServiceUnavailableError")),
        (503, vllm_error(MESSAGES["max_num_queued_reqs"], code=500)),
        (503, b"[1, 2]"),
    ],
)
def test_any_other_answer_is_not_busy(status: int, body: bytes) -> None:
    assert overload_reason(status, body) is None


def test_a_busy_answer_says_nothing_of_the_replicas_health() -> None:
    busy = ReplicaBusy("busy", reason="max_num_queued_reqs")
    assert replica_failed(Outcome(status=503, failure=busy), stream=False) is None
    assert replica_failed(Outcome(status=503, failure=BadAnswer("503")), stream=False) is True


def test_a_refusal_holds_the_replica_at_what_this_instance_held_until_one_of_them_ends() -> None:
    clock = Clock()
    marks = Backpressure(clock)
    for _ in range(3):
        marks.placed("a")
    marks.refused("a", backoff_s=60)  # the third was refused: two of ours run there
    marks.released("a")
    assert marks.busy("a")  # the refused one gave its slot back: still two
    marks.released("a")
    assert not marks.busy("a")  # one of the two ended: room for one
    marks.placed("a")
    assert marks.busy("a")  # and only one
    assert not marks.busy("b")  # replicas are apart


def test_a_refusal_with_nothing_of_ours_there_holds_until_the_backoff_lapses() -> None:
    clock = Clock()
    marks = Backpressure(clock)
    marks.placed("a")
    marks.refused("a", backoff_s=2.0)
    marks.released("a")
    assert marks.busy("a") and marks.lapses_in("a") == 2.0
    clock.now = 1.5
    assert marks.busy("a") and marks.lapses_in("a") == 0.5
    clock.now = 2.0
    assert not marks.busy("a") and marks.lapses_in("a") == 0.0


def test_forgotten_replicas_lose_their_marks_unless_slots_are_still_held_there() -> None:
    marks = Backpressure(Clock())
    marks.placed("kept")
    marks.refused("kept", backoff_s=60)
    marks.placed("gone")
    marks.refused("gone", backoff_s=60)
    marks.released("gone")
    marks.forget(set())
    assert marks.busy("kept") and not marks.busy("gone")
