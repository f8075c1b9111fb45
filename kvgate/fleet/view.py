"""The fleet view: the one place the immutable `Fleet` is built, from the replicas, their
circuits and what admission knows of each replica's ledger.

Routing ranks against it, admission places on the ranking it gives, the gauges export it and
`/admin/replicas` shows it: every reader sees the same figures, taken by the same code. The
view only reads its inputs; it owns no state, so taking a fleet costs one pass over the
replicas and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvgate.config import Config
from kvgate.fleet.replicas import Replica
from kvgate.fleet.snapshot import Fleet, TypicalSizes, take_snapshot


class AdmissionFigures(Protocol):
    """What admission knows of each replica and pool that the fleet shows. Read-only for the
    view, on the event loop, for every replica on every ranking: each read must be a lookup
    (constant time, never awaited). Implemented by `kvgate.admission.stage.Admission`."""

    @property
    def reserved(self) -> Mapping[str, int]:
        """Blocks on each replica's ledger, by every instance, as this instance sees them."""
        ...

    @property
    def exact(self) -> Mapping[str, int]:
        """Of `reserved`, this instance's reservations of their worst case, per replica."""
        ...

    @property
    def lower(self) -> Mapping[str, int]:
        """Of `reserved`, this instance's reservations of the classes below critical."""
        ...

    def shared_prefix_blocks(self, replica_id: str) -> int:
        """Blocks this instance holds on the replica as shared-prefix leases."""
        ...

    def overcommit_factor(self, replica_id: str) -> float:
        """How far predicted reservations may overcommit the replica (>= 1)."""
        ...

    def busy(self, replica_id: str) -> bool:
        """The replica's vLLM refused one of ours as busy: no new request from us for now."""
        ...

    def typical_sizes(self, pool: str) -> TypicalSizes:
        """The pool's recent p95 request sizes, for headroom in requests."""
        ...


class Circuits(Protocol):
    """Each replica's circuit: "closed", "half_open" or "open" (`kvgate.fleet.health`)."""

    def state(self, replica_id: str) -> str: ...


# How long a request's arrival snapshot of the fleet may serve its first ranking.
FLEET_REUSE_S = 0.002


@dataclass(slots=True)
class FleetView:
    """Takes the fleet as it is now. `replicas`: the registry (any iterable of replicas: a
    test's own list will do); `circuits`: the breakers (None: every circuit closed)."""

    replicas: Iterable[Replica]
    figures: AdmissionFigures
    circuits: Circuits | None = None

    def take(self, config: Config, now: float | None = None) -> Fleet:
        """The fleet under `config` (a request's own, or the one in force)."""
        figures, circuits = self.figures, self.circuits
        return take_snapshot(
            self.replicas,
            config=config.admission,
            stale_after_s=config.discovery.stale_after_s,
            reserved=figures.reserved,
            exact=figures.exact,
            lower=figures.lower,
            shared_prefix_blocks=figures.shared_prefix_blocks,
            circuit=circuits.state if circuits is not None else _closed,
            overcommit=figures.overcommit_factor,
            typical_sizes=figures.typical_sizes,
            busy=figures.busy,
            critical=config.critical_pools.__contains__,
            now=now,
        )

    def still_current(self, fleet: Fleet) -> bool:
        """A request's arrival snapshot is good for its first ranking while it is fresh and
        no reservation moved since: within FLEET_REUSE_S health and circuits change no more
        than between rank and send."""
        if time.monotonic() - fleet.taken_at > FLEET_REUSE_S:
            return False
        reserved = self.figures.reserved
        return all(v.reserved_blocks == reserved.get(v.id, 0) for v in fleet)


def _closed(replica_id: str) -> str:
    return "closed"
