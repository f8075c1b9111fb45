"""How far admission may trust its predictions on each replica: an AIMD controller fed by the
replica's own metrics.

Predicted reservations are a bet that answers stay near their usual length. The replica says
how the bet goes: `vllm:num_preemptions_total` rises when vLLM ran out of blocks mid-decode,
and `vllm:admission_rejections_total` when its own queue limits (`--max-num-queued-reqs`,
`--max-num-queued-tokens`) refused work as more than it can take (either way the bet lost:
back off at once, multiplicatively), while `vllm:kv_cache_usage_perc` with room
to spare and requests waiting in kvgate's queue say blocks are idle that could serve them
(grow, additively) — unless the replica's own waiting queue is not empty: then it has more
than it can start, and more would only wait there, out of kvgate's fair order (shrink back
towards 1). The factor scales the replica's admissible blocks for predicted-mode
requests; worst-case requests never see more than the plain limit. Pure: fed one scrape at a
time, no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

LOW, HIGH = 0.5, 2.0  # the factor's bounds
STEP = 0.1  # added per scrape while there is room and demand
BACKOFF = 0.7  # multiplied on a new preemption or admission rejection
ROOM = 0.85  # vLLM's own usage below this counts as room


@dataclass(slots=True)
class _Replica:
    factor: float = 1.0
    preemptions: float | None = None
    rejections: float | None = None


class Overcommit:
    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}

    def factor(self, replica_id: str) -> float:
        state = self._replicas.get(replica_id)
        return 1.0 if state is None else state.factor

    def observe(
        self,
        replica_id: str,
        *,
        preemptions: float | None,
        kv_usage: float | None,
        demand: bool,
        waiting: float | None = None,
        rejections: float | None = None,
    ) -> float:
        """Fold in one fresh scrape; `demand`: requests are waiting for capacity here;
        `waiting`: the replica's own queue (requests it accepted but has not started);
        `rejections`: requests its queue limits refused, since it started."""
        state = self._replicas.setdefault(replica_id, _Replica())
        if _rose(state.preemptions, preemptions) or _rose(state.rejections, rejections):
            state.factor = max(LOW, state.factor * BACKOFF)
        elif waiting:  # it already has more than it runs: sending more only adds to its queue
            state.factor = max(1.0, state.factor - STEP) if state.factor > 1.0 else state.factor
        elif demand and kv_usage is not None and kv_usage < ROOM:
            state.factor = min(HIGH, state.factor + STEP)
        state.preemptions, state.rejections = preemptions, rejections
        return state.factor

    def items(self) -> list[tuple[str, float]]:
        return [(r, s.factor) for r, s in self._replicas.items()]


def _rose(before: float | None, now: float | None) -> bool:
    """A cumulative vLLM counter grew since the last scrape (a restart only resets it)."""
    return before is not None and now is not None and now > before
