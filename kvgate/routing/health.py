"""Passive health: a circuit breaker per replica, fed by what its answers show.

    closed ──(failure_threshold failures in a row)──► open ──(open_s later)──► half_open
      ▲                                                 ▲                        │
      └──────────── the trial request succeeds ─────────┴─ the trial fails ◄─────┘

A failure is what says the replica, not the request, is broken: the connection failed, it
answered 5xx, or it went silent past a timeout. A 4xx is the client's problem and counts as a
success. While open the replica takes no new requests; half open it takes one trial at a time.
Active checks (discovery's `/health`) mark a replica unhealthy on their own; the two combine in
the router's filter. State is per instance: each kvgate learns from its own traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # kvgate_replica_circuit_state


@dataclass(slots=True)
class _Circuit:
    failures: int = 0  # consecutive
    opened_at: float | None = None
    trial: bool = False  # a half-open trial request is in flight


class Breakers:
    def __init__(
        self,
        failure_threshold: Callable[[], int],
        open_s: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str], None] = lambda replica, state: None,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.clock = clock
        self.on_change = on_change
        self._circuits: dict[str, _Circuit] = {}

    def state(self, replica_id: str) -> str:
        circuit = self._circuits.get(replica_id)
        if circuit is None or circuit.opened_at is None:
            return CLOSED
        if self.clock() - circuit.opened_at < self.open_s():
            return OPEN
        return OPEN if circuit.trial else HALF_OPEN  # one trial at a time

    def begin(self, replica_id: str) -> None:
        """A request is being sent: if half open, it is the trial."""
        if self.state(replica_id) == HALF_OPEN:
            self._circuits[replica_id].trial = True

    def judge(self, replica_id: str, failed: bool | None) -> None:
        """What one request showed: the replica failed, answered, or nothing (the client left
        first; a trial it was ends without a verdict, and the next request is the trial)."""
        if failed is True:
            self.failure(replica_id)
        elif failed is False:
            self.success(replica_id)
        elif (circuit := self._circuits.get(replica_id)) is not None:
            circuit.trial = False

    def success(self, replica_id: str) -> None:
        circuit = self._circuits.get(replica_id)
        if circuit is None:
            return
        was_open = circuit.opened_at is not None
        circuit.failures, circuit.opened_at, circuit.trial = 0, None, False
        if was_open:
            self.on_change(replica_id, CLOSED)

    def failure(self, replica_id: str) -> None:
        circuit = self._circuits.setdefault(replica_id, _Circuit())
        circuit.failures += 1
        if circuit.opened_at is not None:
            if circuit.trial:  # the trial failed: open again for a full period
                circuit.opened_at, circuit.trial = self.clock(), False
                self.on_change(replica_id, OPEN)
            return
        if circuit.failures >= self.failure_threshold():
            circuit.opened_at = self.clock()
            self.on_change(replica_id, OPEN)

    def forget(self, keep: set[str]) -> None:
        """Drop the state of replicas no longer configured."""
        for replica_id in list(self._circuits):
            if replica_id not in keep:
                del self._circuits[replica_id]
