"""Passive health: a circuit breaker per replica, fed by what its answers show.

    closed ──(failure_threshold failures in a row)──► open ──(open_s later)──► half_open
      ▲                                                 ▲                        │
      └──────────── the trial request succeeds ─────────┴─ the trial fails ◄─────┘

A failure is what says the replica, not the request, is broken: the connection failed, it
answered 5xx, or a stream went silent past a timeout. A 4xx says nothing either way (the
client's problem, or a replica that answers but serves nothing useful). While open the replica
takes no new requests; half open it takes one trial request at a time, judged as soon as its
answer's status arrives.
Active checks (discovery's `/health`) mark a replica unhealthy on their own; the two combine in
the router's filter. State is per instance: each kvgate learns from its own traffic. The
circuits are every request's, so their settings (`routing.circuit`) are the config in force.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.config import CurrentConfig

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # kvgate_replica_circuit_state


@dataclass(slots=True)
class _Circuit:
    failures: int = 0  # consecutive
    opened_at: float | None = None
    trial: str | None = None  # the request that holds the half-open trial


class Breakers:
    """One circuit per replica. `state` is what the fleet snapshot shows: closed, open
    (cooling down), half_open (the trial window). Requests are let through a half-open circuit
    one at a time: `claim` gives the trial to the first request that ranks the replica, and
    only that request's verdict decides; verdicts of requests sent before the circuit opened
    are ignored while it is open."""

    def __init__(
        self,
        current: CurrentConfig,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str], None] = lambda replica, state: None,
    ) -> None:
        self.current = current
        self.clock = clock
        self.on_change = on_change
        self._circuits: dict[str, _Circuit] = {}

    def state(self, replica_id: str) -> str:
        circuit = self._circuits.get(replica_id)
        if circuit is None or circuit.opened_at is None:
            return CLOSED
        if self.clock() - circuit.opened_at < self.current().routing.circuit.open_s:
            return OPEN
        return HALF_OPEN

    def claim(self, replica_id: str, holder: str) -> bool:
        """May request `holder` be sent to this replica? Always while the circuit is closed;
        half open, only the request holding the trial (the first to claim it)."""
        state = self.state(replica_id)
        if state == CLOSED:
            return True
        if state == OPEN:
            return False
        circuit = self._circuits[replica_id]
        if circuit.trial is None:
            circuit.trial = holder
        return circuit.trial == holder

    def release(self, holder: str) -> None:
        """The request is over: a trial it claimed but never judged goes to the next one."""
        for circuit in self._circuits.values():
            if circuit.trial == holder:
                circuit.trial = None

    def judge(self, replica_id: str, failed: bool | None, holder: str) -> None:
        """What one request showed of the replica: it failed, it answered, or nothing (the
        client left first, or a 4xx that says nothing of the replica)."""
        circuit = self._circuits.setdefault(replica_id, _Circuit())
        if circuit.opened_at is not None:  # open: only the trial's verdict counts
            if circuit.trial != holder or failed is None:
                return
            if failed:  # the trial failed: open again for a full period
                circuit.opened_at, circuit.trial = self.clock(), None
                self.on_change(replica_id, OPEN)
            else:
                circuit.failures, circuit.opened_at, circuit.trial = 0, None, None
                self.on_change(replica_id, CLOSED)
            return
        if failed is False:
            circuit.failures = 0
        elif failed:
            circuit.failures += 1
            if circuit.failures >= self.current().routing.circuit.failure_threshold:
                circuit.opened_at = self.clock()
                self.on_change(replica_id, OPEN)

    def forget(self, keep: set[str]) -> None:
        """Drop the state of replicas no longer in the fleet."""
        for replica_id in list(self._circuits):
            if replica_id not in keep:
                del self._circuits[replica_id]
