"""The circuit breaker: consecutive failures open it, a trial after open_s closes or reopens."""

from __future__ import annotations

from kvgate.routing.health import CLOSED, HALF_OPEN, OPEN, Breakers


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def breakers(clock: Clock, changes: list[tuple[str, str]]) -> Breakers:
    return Breakers(lambda: 3, lambda: 10.0, clock, lambda r, s: changes.append((r, s)))


def trip(b: Breakers, replica: str = "a") -> None:
    """Three failures in a row: the threshold."""
    for _ in range(3):
        b.judge(replica, True)


def test_consecutive_failures_open_the_circuit_and_a_success_between_resets_the_count():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    b.judge("a", True)
    b.judge("a", True)
    b.judge("a", False)  # answered: the count starts again
    b.judge("a", True)
    b.judge("a", True)
    assert b.state("a") == CLOSED
    b.judge("a", True)
    assert b.state("a") == OPEN and changes == [("a", OPEN)]


def test_after_open_s_one_trial_goes_through_and_its_success_closes_the_circuit():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    trip(b)
    clock.now = 9.9
    assert b.state("a") == OPEN
    clock.now = 10.0
    assert b.state("a") == HALF_OPEN
    b.begin("a")
    assert b.state("a") == OPEN  # one trial at a time
    b.judge("a", False)
    assert b.state("a") == CLOSED and changes[-1] == ("a", CLOSED)


def test_a_failed_trial_opens_the_circuit_for_another_full_period():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    trip(b)
    clock.now = 10.0
    b.begin("a")
    b.judge("a", True)
    assert b.state("a") == OPEN
    clock.now = 19.9
    assert b.state("a") == OPEN
    clock.now = 20.0
    assert b.state("a") == HALF_OPEN


def test_a_trial_the_client_abandoned_lets_the_next_request_be_the_trial():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    trip(b)
    clock.now = 10.0
    b.begin("a")
    b.judge("a", None)  # the client left before the replica showed anything
    assert b.state("a") == HALF_OPEN


def test_replicas_have_circuits_of_their_own_and_forgotten_ones_close():
    clock, changes = Clock(), []
    b = breakers(clock, changes)
    trip(b)
    assert (b.state("a"), b.state("b")) == (OPEN, CLOSED)
    b.forget({"b"})
    assert b.state("a") == CLOSED
