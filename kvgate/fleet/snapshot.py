"""One immutable picture of the fleet: every replica's health, circuit, capacity, ledger and
scraped vLLM figures, taken at one moment by `take_snapshot` (through `kvgate.fleet.view`).

The router ranks against it, the gauges export it, `/admin/replicas` shows it and `kvgate top`
reads that: one formula for admissible blocks, reserved blocks and headroom, not one per
reader. Pure values; the live `Replica` rides along for the stages that talk to it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from kvgate.config import AdmissionConfig
from kvgate.fleet.replicas import Replica
from kvgate.tools.capacity import headroom_requests

# The two sizes headroom is told in: requests as predicted-mode admission reserves them, under
# the predicted-mode limit; and their worst cases, under the admissible blocks.
Basis = Literal["predicted", "worst_case"]
BASES: tuple[Basis, ...] = ("predicted", "worst_case")


class TypicalSizes(NamedTuple):
    """A pool's recent requests, each basis's 95th percentile in blocks (None: none seen)."""

    predicted: int | None = None  # what predicted requests reserved on arrival
    worst_case: int | None = None  # every request's worst case


class ReplicaView(NamedTuple):
    """One replica as the snapshot saw it. A NamedTuple, not a frozen dataclass: every request
    builds one per replica of the fleet, and a NamedTuple builds faster."""

    replica: Replica
    id: str
    pool: str
    healthy: bool  # the last active check (/health, /v1/models) passed
    circuit: str  # "closed", "half_open" or "open" (passive failures)
    busy: bool  # vLLM's queue limits refused one of ours: no new request from us for now
    draining: bool
    models: frozenset[str]
    block_size: int
    num_gpu_blocks: int | None
    admissible_blocks: int | None  # target_utilization × num_gpu_blocks
    kept_blocks: int  # of those, what only the critical class may use
    reserved_blocks: int  # on the shared ledger, by every instance
    exact_blocks: int  # of those, this instance's reservations of their worst case
    lower_blocks: int  # of those, this instance's reservations of the classes below critical
    shared_prefix_blocks: int
    inflight: int
    overcommit: float
    typical: TypicalSizes  # the pool's recent p95 sizes, for headroom in requests
    scraped: bool  # vLLM's figures below are fresh
    # vLLM's own figures, when a scrape is fresh (None: unknown)
    waiting: float | None
    running: float | None
    kv_usage: float | None
    preemptions: float | None
    prefix_hit_rate: float | None
    scrape_age_s: float | None

    @property
    def routable(self) -> bool:
        """Takes new requests: healthy, not draining, circuit not open."""
        return self.healthy and not self.draining and self.circuit != "open"

    def headroom_blocks(self, basis: Basis) -> int | None:
        """Room left on the ledger for one more request of `basis`, in its own blocks: a
        predicted one up to the predicted-mode limit; a worst case in the blocks the replica
        really has left (`limit`: predicted reservations hold about 1/overcommit of theirs)."""
        admissible = self.admissible_blocks
        if admissible is None:
            return None
        if basis == "predicted":
            return max(0, self._scaled(admissible) - self.reserved_blocks)
        predicted = max(0, self.reserved_blocks - self.exact_blocks)
        return max(0, int(admissible - self.exact_blocks - predicted / self.overcommit))

    @property
    def written_blocks(self) -> int:
        """Blocks this instance's requests there have written so far: read when asked (the
        gauges and the admin view), not on every ranking."""
        return self.replica.written_blocks()

    def headroom_requests(self, basis: Basis) -> int | None:
        """How many more requests of the pool's recent p95 size on `basis` fit on the ledger
        now: at predicted demand, or at the worst case. None while either is unknown."""
        room, size = self.headroom_blocks(basis), getattr(self.typical, basis)
        if room is None or not size:
            return None
        return headroom_requests(room, 0, size)

    @property
    def load(self) -> float:
        """Reserved share of what may be admitted, in [0, 1]; 1 when capacity is unknown."""
        if not self.admissible_blocks:
            return 1.0
        return min(1.0, self.reserved_blocks / self.admissible_blocks)

    def limit(self, predicted: bool, priority: str = "critical", blocks: int = 0) -> int | None:
        """The most the ledger (reserved, every instance's) may hold with a request of
        `blocks` on it. Predicted reservations hold about 1/overcommit of what they reserve
        — the factor is how far this replica's own metrics say they can be trusted — and a
        worst-case reservation holds all of it (this instance's: `exact_blocks`), so what
        the replica really holds, predicted / factor + exact, stays within the admissible
        blocks. Blocks kept for the critical class are not offered to the other classes,
        unless the request's reservation could never fit without them. The lower classes'
        answers still grow past their limit (growth is never refused: the tokens are being
        written); the kept blocks then stay the critical class's on top of that overrun."""
        admissible = self.admissible_blocks
        if admissible is None:
            return None
        kept, overrun = self.kept_blocks, 0
        if priority != "critical":
            if blocks <= admissible - kept:
                admissible -= kept
        elif kept:
            overrun = max(0, self.lower_blocks - self._scaled(admissible - kept))
        if predicted:
            return self._scaled(admissible) + overrun
        return self._scaled(admissible - blocks) + blocks + overrun

    def _scaled(self, admissible: int) -> int:
        """The ledger total at which the replica really holds `admissible` blocks."""
        exact = self.exact_blocks
        return int((admissible - exact) * self.overcommit) + exact

    def max_model_len(self, model: str) -> int | None:
        return self.replica.max_model_len(model)


@dataclass(frozen=True, slots=True)
class Fleet:
    views: tuple[ReplicaView, ...]
    taken_at: float

    def __iter__(self) -> Iterator[ReplicaView]:
        return iter(self.views)

    def __len__(self) -> int:
        return len(self.views)

    def get(self, replica_id: str) -> ReplicaView | None:
        return next((v for v in self.views if v.id == replica_id), None)

    def in_pool(self, pool: str) -> list[ReplicaView]:
        return [v for v in self.views if v.pool == pool]

    def max_model_len(self, model: str, pool: str) -> int | None:
        """The largest context any routable replica of the pool reports for `model` (the
        router then skips replicas whose own limit is smaller)."""
        lengths = [
            n for v in self.in_pool(pool)
            if v.routable and model in v.models and (n := v.max_model_len(model)) is not None
        ]
        return max(lengths) if lengths else None


def admissible_blocks(replica: Replica, config: AdmissionConfig) -> int | None:
    """The most a replica's ledger may hold of worst-case reservations."""
    total = replica.num_gpu_blocks
    return None if total is None else int(total * config.target_utilization)


def kept_blocks(admissible: int | None, config: AdmissionConfig, critical: bool) -> int:
    """The blocks of `admissible` only critical requests may use, where a critical tenant
    may send requests (`critical`)."""
    if admissible is None or not critical:
        return 0
    return math.ceil(admissible * config.critical_headroom)


def take_snapshot(
    replicas: Iterable[Replica],
    *,
    config: AdmissionConfig,
    stale_after_s: float,
    reserved: Mapping[str, int],
    exact: Mapping[str, int] | None = None,
    lower: Mapping[str, int] | None = None,
    shared_prefix_blocks: Callable[[str], int],
    circuit: Callable[[str], str],
    overcommit: Callable[[str], float],
    typical_sizes: Callable[[str], TypicalSizes] = lambda pool: TypicalSizes(),
    busy: Callable[[str], bool] = lambda replica_id: False,
    critical: Callable[[str], bool] = lambda pool: False,
    now: float | None = None,
) -> Fleet:
    """`critical(pool)`: a critical tenant may send requests there, so its headroom is kept."""
    now = time.monotonic() if now is None else now
    views = []
    typical: dict[str, TypicalSizes] = {}  # per pool, read once
    predicted = config.mode == "predicted"
    for r in replicas:
        rid = r.id
        scrape = r.fresh_scrape(stale_after_s, now)
        factor = overcommit(rid) if predicted else 1.0
        admissible = admissible_blocks(r, config)
        hit_rate = None
        if scrape is not None and scrape.prefix_queries and scrape.prefix_hits is not None:
            hit_rate = scrape.prefix_hits / scrape.prefix_queries
        views.append(ReplicaView(
            replica=r, id=rid, pool=r.pool, healthy=r.healthy, circuit=circuit(rid),
            busy=busy(rid),
            draining=r.draining, models=r.models, block_size=r.kv_block_size,
            num_gpu_blocks=r.num_gpu_blocks,
            admissible_blocks=admissible,
            kept_blocks=kept_blocks(admissible, config, critical(r.pool)),
            reserved_blocks=reserved.get(rid, 0),
            exact_blocks=exact.get(rid, 0) if exact else 0,
            lower_blocks=lower.get(rid, 0) if lower else 0,
            shared_prefix_blocks=shared_prefix_blocks(rid), inflight=len(r.inflight),
            overcommit=factor,
            typical=typical[r.pool] if r.pool in typical else typical.setdefault(
                r.pool, typical_sizes(r.pool)),
            scraped=scrape is not None,
            waiting=scrape.waiting if scrape else None,
            running=scrape.running if scrape else None,
            kv_usage=scrape.kv_usage if scrape else None,
            preemptions=scrape.preemptions if scrape else None,
            prefix_hit_rate=hit_rate,
            scrape_age_s=None if r.scrape is None else round(now - r.scrape.at, 3),
        ))
    return Fleet(tuple(views), now)
