"""Placement rules: which replica of a request's ranking admission may reserve on, checked at
the moment of placing it against the snapshot it was ranked with; the ledger then re-checks
the limit against every instance's reservations (`Ledger.reserve`).

These stay admission's rather than routing filters: a replica the request can never fit on
must still reach `check_can_ever_fit` (a 400 that names the largest replica, not a 503), and a
replica whose vLLM queue is long is still one the request waits for (its queue's wait counts
in the expected wait, and its sizes in the pool's typical sizes).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.admission.backpressure import Backpressure
from kvgate.admission.demand import Demand
from kvgate.config import AdmissionConfig
from kvgate.errors import NeverFits, NoReplica, RateLimited
from kvgate.fleet.replicas import Replica
from kvgate.fleet.snapshot import ReplicaView
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
