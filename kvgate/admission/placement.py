"""Placement rules: which replica of a request's ranking admission may reserve on, checked at
the moment of placing it against the snapshot it was ranked with; the ledger then re-checks
the limit against every instance's reservations (`Ledger.reserve`).

These stay admission's rather than routing filters: a replica the request can never fit on
must still reach `check_can_ever_fit` (a 400 that names the largest replica, not a 503), and a
replica whose vLLM queue is long is still one the request waits for (its queue's wait counts
in the expected wait, and its sizes in the pool's typical sizes).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from kvgate.admission.backpressure import Backpressure
from kvgate.admission.demand import Demand, Slot
from kvgate.admission.ledger import Ledger
from kvgate.admission.room import Room
from kvgate.config import AdmissionConfig
from kvgate.errors import NeverFits, NoReplica, RateLimited
from kvgate.fleet.replicas import Replica
from kvgate.fleet.snapshot import ReplicaView
from kvgate.metrics import Metrics
from kvgate.routing.ranking import Ranking


def limit_for(view: ReplicaView, demand: Demand, config: AdmissionConfig) -> int | None:
    """The most `view`'s ledger may hold with the demand on it, or None when the demand may
    not go there now: its capacity is unknown, the demand alone exceeds it, or its vLLM queue
    is longer than `max_replica_waiting` and would hold it (`Demand.first_in_vllm`)."""
    limit = demand.limit_on(view)
    if limit is None or demand.blocks_on(view.replica) > limit:
        return None
    if (view.waiting or 0) > config.max_replica_waiting and not demand.first_in_vllm:
        return None
    return limit


def check_can_ever_fit(
    demand: Demand, candidates: Sequence[ReplicaView], config: AdmissionConfig
) -> None:
    """Raises NoReplica without a candidate of known capacity, and NeverFits (400) when the
    demand would not fit on any of them even empty."""
    if not candidates:
        raise NoReplica(f"no healthy replica in pool {demand.pool!r} can take this request")
    known = [(v.replica, v.admissible_blocks) for v in candidates if v.admissible_blocks is not None]
    if not known:
        raise NoReplica(
            f"no replica in pool {demand.pool!r} has a known KV capacity yet; retry shortly"
        )
    # a predicted reservation needs its prediction to fit (it may grow past any limit, as
    # it would on vLLM, which serves every context that fits its cache); a worst case, all
    if all(demand.blocks_on(r) > n for r, n in known):
        best = max(known, key=lambda rn: rn[1])
        raise NeverFits(
            f"this request's worst case is {demand.worst_tokens} tokens = "
            f"{demand.blocks_on(best[0])} KV blocks, but the largest replica in pool "
            f"{demand.pool!r} admits at most {best[1]} blocks "
            f"({config.target_utilization:g} × {best[0].num_gpu_blocks}); "
            "reduce max_tokens or the prompt",
            param="max_tokens",
        )


def first_not_busy(demand: Demand, ranking: Ranking, backpressure: Backpressure) -> Replica:
    """Without admission, the first replica that is not busy; 429 when all of them are."""
    for view in ranking.replicas:
        if not view.busy:
            return view.replica
    retry_after = min(backpressure.lapses_in(v.id) for v in ranking.replicas)
    raise RateLimited(
        f"every replica in pool {demand.pool!r} is busy (vLLM's queue limits)",
        code="replicas_busy", retry_after_s=retry_after,
    )


@dataclass(slots=True)
class Placer:
    """Places a demand on the first replica of its ranking whose ledger takes it, or whose
    vLLM could carry it now (work conservation, `Room`); `on_stale`: what gives back a slot
    whose request holds it past its demand's longest hold."""

    ledger: Ledger
    room: Room
    backpressure: Backpressure
    metrics: Metrics
    on_stale: Callable[[Demand, Slot], Awaitable[None]]

    async def place(
        self, demand: Demand, ranking: Ranking, config: AdmissionConfig, waited_s: float,
        closed: frozenset[str] = frozenset(), *, conserve: bool = True,
    ) -> Slot | None:
        """The first of the replicas the ranking lets a request that has waited `waited_s`
        use (`Ranking.usable`), not `closed` to this request, whose ledger takes the demand,
        or (`conserve`) whose vLLM could carry it now (`Room.limit`)."""
        for view, limit, conserved in self._limits(
            demand, ranking, config, waited_s, closed, conserve
        ):
            slot = await self.ledger.reserve(
                view.replica, demand, limit, config.lease_ttl_s,
                on_stale=lambda stale: self.on_stale(demand, stale),
            )
            if slot is not None:
                self.backpressure.placed(view.id)
                slot.queued_s = waited_s
                if conserved:
                    self.metrics.work_conserving.labels(demand.pool, view.id).inc()
                return slot
        return None

    def fits(
        self, demand: Demand, ranking: Ranking, config: AdmissionConfig, only: frozenset[str],
        conserve: bool,
    ) -> bool:
        """Whether one of the replicas `only` that the ranking lets the demand use has room
        for it now, on its ledger or (`conserve`) by its vLLM's own figures (nothing is
        reserved)."""
        closed = frozenset(v.id for v in ranking.replicas) - only
        return any(
            view.reserved_blocks + demand.blocks_on(view.replica) <= limit
            for view, limit, _ in self._limits(demand, ranking, config, math.inf, closed, conserve)
        )

    def _limits(
        self, demand: Demand, ranking: Ranking, config: AdmissionConfig, waited_s: float,
        closed: frozenset[str], conserve: bool,
    ) -> Iterator[tuple[ReplicaView, int, bool]]:
        """In ranking order, each replica the demand may be placed on after `waited_s`, not
        `closed` to it, with the most its ledger may hold with the demand on it: the ledger's
        own limit, or (`conserve`) past it where its vLLM could carry the demand now, and
        whether it is that."""
        for view in ranking.usable(waited_s):
            if view.id in closed or (limit := limit_for(view, demand, config)) is None:
                continue
            # work conservation, asked only for requests without a latency target: the wait
            # estimate that refuses those at arrival is read from the ledger, and letting
            # requests past it under overload cost the production trace at 3x a fifth of its
            # goodput (4.25 against 5.28, docs/admission.md)
            room = self.room.limit(view, demand, limit) if conserve else None
            yield view, (limit if room is None else room), room is not None
