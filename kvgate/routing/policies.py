"""Routing policies: given a request and the candidate replicas of its pool, the order in
which admission should try them. Admission takes the first that fits, so a policy expresses a
preference, never a promise: affinity never overrides capacity.

A policy is a small class with one method; policies are registered by name in `POLICIES`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from kvgate.replicas import Replica


class RoutingPolicy(Protocol):
    """`order` returns the candidates, best first. Pure and synchronous; called once per
    request (and again each time a queued request is retried)."""

    def order(self, candidates: Sequence[Replica], reserved: Mapping[str, int]) -> list[Replica]: ...


class LeastLoaded:
    """Most free ledger capacity first (fraction of num_gpu_blocks not reserved), then the
    shortest scraped vLLM waiting queue."""

    def order(self, candidates: Sequence[Replica], reserved: Mapping[str, int]) -> list[Replica]:
        def load(replica: Replica) -> tuple[float, float]:
            total = replica.num_gpu_blocks or 1
            waiting = replica.scrape.waiting if replica.scrape and replica.scrape.waiting else 0.0
            return (reserved.get(replica.id, 0) / total, waiting)

        return sorted(candidates, key=load)


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def order(self, candidates: Sequence[Replica], reserved: Mapping[str, int]) -> list[Replica]:
        if not candidates:
            return []
        start = self._next % len(candidates)
        self._next += 1
        return [*candidates[start:], *candidates[:start]]


POLICIES: dict[str, type[LeastLoaded] | type[RoundRobin]] = {
    "least_loaded": LeastLoaded,
    "round_robin": RoundRobin,
}
