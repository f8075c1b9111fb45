"""The circuit breaker: consecutive failures open it; after open_s one request at a time holds
the trial, and only its verdict closes or reopens the circuit."""

from __future__ import annotations

from kvgate.fleet.health import CLOSED, HALF_OPEN, OPEN, Breakers
from tests.plugins.gateway import gateway_config


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CONFIG = gateway_config(["http://a:8000"], routing={"circuit": {"failure_threshold": 3, "open_s": 10}})


def breakers(clock: Clock, changes: list[tuple[str, str]]) -> Breakers:
    return Breakers(lambda: CONFIG, clock, lambda r, s: changes.append((r, s)))


def trip(b: Breakers, replica_id: str = "a") -> None:
    """Three failures in a row: the threshold."""
    for i in range(3):
        b.judge(replica_id, True, f"old-{i}")


def test_consecutive_failures_open_the_circuit_and_a_success_between_resets_the_count():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    b.judge("a", True, "r1")
    b.judge("a", True, "r2")
    b.judge("a", False, "r3")  # answered: the count starts again
    b.judge("a", None, "r4")  # a 4xx, or the client left: says nothing
    b.judge("a", True, "r5")
    b.judge("a", True, "r6")
    assert b.state("a") == CLOSED
    b.judge("a", True, "r7")
    assert b.state("a") == OPEN and changes == [("a", OPEN)]


def test_after_open_s_only_the_trial_holder_is_let_through_and_its_success_closes_it():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    trip(b)
    assert not b.claim("a", "early")
    clock.now = 10.0
    assert b.state("a") == HALF_OPEN
    assert b.claim("a", "trial") and b.claim("a", "trial")
    assert not b.claim("a", "another")  # one trial at a time
    b.judge("a", False, "a-request-from-before")  # not the trial: ignored while open
    assert b.state("a") == HALF_OPEN
    b.judge("a", False, "trial")
    assert b.state("a") == CLOSED and changes[-1] == ("a", CLOSED)
    assert b.claim("a", "another")


def test_a_failed_trial_opens_the_circuit_for_another_full_period():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    trip(b)
    clock.now = 10.0
    assert b.claim("a", "trial")
    b.judge("a", True, "trial")
    assert b.state("a") == OPEN
    clock.now = 19.9
    assert b.state("a") == OPEN
    clock.now = 20.0
    assert b.state("a") == HALF_OPEN


def test_a_trial_that_ends_without_a_verdict_goes_to_the_next_request():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    trip(b)
    clock.now = 10.0
    assert b.claim("a", "trial")
    b.judge("a", None, "trial")  # the client left first
    b.release("trial")  # the request is over
    assert b.claim("a", "next")


def test_replicas_have_circuits_of_their_own_and_forgotten_ones_close():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    trip(b)
    assert (b.state("a"), b.state("b")) == (OPEN, CLOSED)
    b.forget({"b"})
    assert b.state("a") == CLOSED
