"""How far admission may trust its predictions on each replica: an AIMD controller fed by the
replica's own metrics, that learns its limit from the signs that come before a preemption.

Predicted reservations are a bet that answers stay near their usual length. The replica says
how the bet goes, and it says so before vLLM has to preempt:

- `vllm:kv_cache_usage_perc` at or above HIGH_WATER: the cache is next to full, and the
  next blocks that running answers need may not be there — shrink (×EASE per scrape);
- vLLM's own waiting queue growing while usage is above ROOM: it accepted more than its
  free blocks let it start — shrink (×EASE per scrape);
- `vllm:num_preemptions_total` or `vllm:admission_rejections_total` (its own queue limits,
  `--max-num-queued-reqs/-tokens`) rising: the bet lost — back off at once (×BACKOFF);
- usage below ROOM while requests want room (they wait in kvgate's queue, or were refused
  at arrival because they would have had to): blocks are idle that could serve them — grow,
  never while usage is at or above ROOM, or unknown. Until the replica first shows a sign
  of its limit (any of the shrinks above and below), it grows as TCP's slow start does, by
  as far as the replica says: the ledger's reservations over the blocks vLLM really holds
  is the factor at which what it holds would meet what admission allows, and the factor
  moves half the way there per scrape (the two are read moments apart, and requests just
  admitted have not been prefilled yet). After that, +STEP per scrape: a jump right after
  easing off would undo the ease within a scrape and overshoot again;
- a waiting queue on the replica while its cache has room (it is limited by something else,
  such as max_num_seqs): more would only wait there, out of kvgate's fair order — shrink back
  towards 1, not below.

The factor scales the replica's admissible blocks for predicted-mode requests; worst-case
requests never see more than the plain limit. Pure: fed one scrape at a time, no clock, no
I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

LOW, HIGH = 0.5, 2.0  # the factor's bounds
STEP = 0.1  # added per scrape while there is room and demand
BACKOFF = 0.7  # multiplied on a new preemption or admission rejection
EASE = 0.9  # multiplied per scrape while a preemption is coming (see the module docstring)
ROOM = 0.85  # vLLM's own usage below this counts as room
STRAINED_SCRAPES = 10  # a preemption keeps a replica "strained" this many scrapes
HIGH_WATER = 0.95  # vLLM's own usage at or above this: the cache is next to full


@dataclass(slots=True)
class _Replica:
    factor: float = 1.0
    settled: bool = False  # it has shown a sign of its limit: growth is additive from now
    preemptions: float | None = None
    rejections: float | None = None
    waiting: float | None = None
    strained: int = 0  # scrapes left before a preemption or admission rejection is forgotten


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
        reserved_per_held: float | None = None,
    ) -> float:
        """Fold in one fresh scrape; `demand`: requests wanted capacity here since the last;
        `waiting`: the replica's own queue (requests it accepted but has not started);
        `rejections`: requests its queue limits refused, since it started;
        `reserved_per_held`: the blocks its ledger reserves over those vLLM holds."""
        state = self._replicas.setdefault(replica_id, _Replica())
        high = kv_usage is not None and kv_usage >= ROOM
        lost = _rose(state.preemptions, preemptions) or _rose(state.rejections, rejections)
        state.strained = STRAINED_SCRAPES if lost else max(0, state.strained - 1)
        if lost:
            state.factor, state.settled = max(LOW, state.factor * BACKOFF), True
        elif (kv_usage is not None and kv_usage >= HIGH_WATER) or (
            high and _rose(state.waiting, waiting)
        ):
            state.factor, state.settled = max(LOW, state.factor * EASE), True
        elif waiting:  # it already has more than it runs: sending more only adds to its queue
            state.settled = True
            state.factor = max(1.0, state.factor - STEP) if state.factor > 1.0 else state.factor
        elif demand and kv_usage is not None and not high:
            towards = 0.0 if state.settled else (reserved_per_held or 0.0) - state.factor
            state.factor = min(HIGH, state.factor + max(STEP, towards / 2))
        state.preemptions, state.rejections, state.waiting = preemptions, rejections, waiting
        return state.factor

    def strained(self, replica_id: str) -> bool:
        """One of its last STRAINED_SCRAPES scrapes showed it preempting, or refusing
        requests at its queue limits: a replica under pressure, to which work conservation
        (`kvgate.admission.room`) sends nothing past the ledger."""
        state = self._replicas.get(replica_id)
        return state is not None and state.strained > 0

    def items(self) -> list[tuple[str, float]]:
        return [(r, s.factor) for r, s in self._replicas.items()]


def _rose(before: float | None, now: float | None) -> bool:
    """A vLLM figure grew since the last scrape (a cumulative counter that went back was
    reset by a restart: not a rise)."""
    return before is not None and now is not None and now > before
