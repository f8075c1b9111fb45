"""Work conservation: a request the ledger has no room for may still start at once where the
replica could run it now, by its own vLLM figures and what kvgate's requests there are
writing.

The ledger counts each predicted reservation at the occupancy its answer is expected to reach
at its end, all at once. Requests do not all reach their ends together: while some grow,
others finish and free their blocks, so the ledger's sum runs well above what vLLM holds
(1.3–1.5× on the benchmark's `mix` at normal load), and a queue would form in kvgate while
the replica has blocks idle, where a bare fleet would have started those requests.

So, when the ledger refuses a predicted request, admission asks (`vllm_room`) whether the
replica could carry it: its last scrape is fresh, shows nothing waiting in vLLM's own queue,
and was not one where vLLM preempted or refused a request at its queue limits; and the
expected peak of what kvgate's requests there will hold, with this one among them, fits in
what is left of the cache after the blocks others hold (vLLM's usage at the scrape less what
kvgate's own requests had written then), what kvgate holds there throughout (worst-case
reservations, shared prefixes, counted once), vLLM's watermark, and the blocks kept for the
critical class where the request is of a lower class.

The peak (`Curve`): every running request writes on at one pace; after n more blocks, one
holds what it has plus n if it is still going then, which it is with the chance its length
model's survival curve gives (`Demand.alive`: the share of known answers of its shape that
got this far and went that much further; without one, it ends at its reservation). The sum
over the requests is read CONFIDENCE standard deviations above its expectation, so that few
long answers of uncertain length get room for their spread. A burst of young requests with
known lengths peaks when they near their ends together, at the sum of their reservations,
as the ledger counts them; requests at staggered stages peak far lower, as some end while
others grow.

Work conservation is for normal load. A replica that preempted (or refused at its queue
limits) in one of its last `overcommit.STRAINED_SCRAPES` (10) scrapes is closed to it: past
capacity, letting more in only trades the ledger's promise for preemptions, and the ledger,
steered by `kvgate.admission.overcommit`, decides alone. Worst-case requests never use this
path: their guarantee is the ledger's, and neither do requests with a latency target
(admission asks `Room.limit` only for those without one).

`Room` keeps what the rule reads between discovery rounds (each replica's last scrape, what
kvgate had written then, a cache of its running requests' curve); the rest is arithmetic.
No I/O.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.admission.demand import Demand, Slot
    from kvgate.admission.ledger import Ledger
    from kvgate.admission.overcommit import Overcommit
    from kvgate.fleet.replicas import Replica
    from kvgate.fleet.snapshot import ReplicaView

# The peak is read this many standard deviations above its expectation: few long answers of
# uncertain length are given room for their spread, many short ones hardly need it.
CONFIDENCE = 2.0
# vLLM keeps this share of its blocks free when it starts a request (its scheduler's
# watermark, 1%); work conservation keeps it too.
WATERMARK = 0.01
# The expected occupancy of a replica's running requests is read as made at most this long
# ago (or since its ledger figure last moved): the answers write on meanwhile.
CURVE_TTL_S = 0.05


@dataclass(frozen=True, slots=True)
class Holding:
    """One request of this instance's on a replica, for its expected occupancy: the blocks
    it holds now, the tokens it has written, and its survival curve (`Demand.alive`; None:
    it ends once it has written its `reserved` blocks)."""

    blocks: int
    written: int
    reserved: int
    alive: Callable[[int, int], float] | None


def holdings(slots: Iterable[Slot], block_size: int) -> list[Holding]:
    """What each of this instance's predicted reservations on one replica holds and may
    write of its own, its shared prefix left out (those blocks are held once for all who
    share them, and counted so: `vllm_room`'s `held`); one not sent yet has written
    nothing."""
    out = []
    for slot in slots:
        if slot.released:
            continue
        written = 0 if slot.progress is None else slot.progress()
        shared = slot.shared.blocks if slot.shared else 0
        blocks = min(max(0, math.ceil(written / block_size) - shared), slot.blocks)
        out.append(Holding(blocks, written, slot.blocks, slot.alive))
    return out


def last_step(holding: Holding) -> int | None:
    """For a request without a survival curve, the step at which it holds the most: the
    last before it ends at its reservation (None: it has a curve, or is there already)."""
    if holding.alive is not None or holding.reserved <= holding.blocks:
        return None
    return holding.reserved - holding.blocks


def steps(longest: int) -> list[int]:
    """The steps (blocks written from now by each running request) the occupancy is read at:
    every one up to 4, then two per doubling, up to `longest`."""
    out, step = [0, 1, 2, 3], 4
    while step < longest:
        out += [step, step * 3 // 2]
        step *= 2
    out.append(longest)
    return sorted({n for n in out if n <= longest})


def occupancy(holding: Holding, at: Sequence[int], block_size: int) -> list[tuple[float, float]]:
    """What `holding` holds after each step of `at` (what it holds now plus what it wrote
    since, if it has not ended by then), as its expectation and variance: it is still going
    with the chance its survival curve gives."""
    blocks = holding.blocks
    if holding.alive is None:  # it ends at its reservation
        return [(float(blocks + n), 0.0) if blocks + n <= holding.reserved else (0.0, 0.0)
                for n in at]  # fmt: skip
    alive = holding.alive
    out = []
    for n in at:
        p, held = alive(holding.written, n * block_size), blocks + n
        out.append((held * p, held * held * p * (1 - p)))
    return out


class Curve:
    """What a replica's running requests are expected to hold after each of a grid of steps
    (`occupancy`, summed, with its variance: the requests end independently): made once,
    then read for each newcomer weighed against it."""

    __slots__ = ("at", "means", "variances")

    def __init__(self, running: Sequence[Holding], block_size: int) -> None:
        longest = max((max(h.reserved, h.blocks) for h in running), default=0)
        ends = {n for h in running if (n := last_step(h)) is not None}
        self.at = sorted(ends.union(steps(max(1, 4 * longest))))
        self.means = [0.0] * len(self.at)
        self.variances = [0.0] * len(self.at)
        for holding in running:
            for i, (mean, variance) in enumerate(occupancy(holding, self.at, block_size)):
                self.means[i] += mean
                self.variances[i] += variance

    def peak_with(self, newcomer: Holding, block_size: int) -> float:
        """The most the running requests and `newcomer` hold at once, at CONFIDENCE standard
        deviations above its expectation at each step. At a step of the newcomer's own past
        the grid, the running requests count what they hold at the grid's nearest steps
        around it, the more of the two."""
        own = last_step(newcomer)
        at = self.at if own is None else sorted({*self.at, own})
        peak = 0.0
        for step, (mine, my_variance) in zip(at, occupancy(newcomer, at, block_size),
                                             strict=True):  # fmt: skip
            i = bisect.bisect_left(self.at, step)
            if i < len(self.at) and self.at[i] == step:
                near = [i]
            else:  # between two grid steps, or past the last
                near = [max(0, i - 1), min(i, len(self.at) - 1)]
            for j in near:
                high = self.means[j] + mine + CONFIDENCE * math.sqrt(self.variances[j] + my_variance)
                peak = max(peak, high)
        return peak


def others_blocks(view: ReplicaView, written_then: int | None) -> int:
    """Blocks vLLM held at its last scrape for requests this instance did not send (other
    instances', clients that bypass kvgate): its usage less what ours had written then
    (`written_then`; None: unknown, so all of its usage), never below 0."""
    assert view.kv_usage is not None and view.num_gpu_blocks
    used = math.ceil(view.kv_usage * view.num_gpu_blocks)
    return max(0, used - (written_then if written_then is not None else 0))


def vllm_room(
    view: ReplicaView, demand: Demand, running: Curve, held: int, written_then: int | None,
) -> bool:
    """Whether the replica could carry the demand now besides `running` (the `Curve` of this
    instance's predicted reservations there, their own blocks) and `held` (the rest of what
    this instance holds there throughout: its worst-case reservations, its shared prefixes),
    by its own vLLM figures (see the module docstring). False when those cannot say: no
    fresh scrape, its size or usage unknown, or requests waiting in its own queue."""
    total = view.num_gpu_blocks
    if not view.scraped or view.kv_usage is None or not total or view.waiting:
        return False
    kept = view.kept_blocks if demand.priority != "critical" else 0
    room = total - math.ceil(WATERMARK * total) - kept - others_blocks(view, written_then) - held
    size = view.block_size
    shared = len(demand.shared_keys_on(view.replica))  # counted in `held` once shared
    blocks = demand.blocks_on(view.replica) - shared
    prompt = min(blocks, max(0, math.ceil(demand.prompt_tokens / size) - shared))
    newcomer = Holding(prompt, demand.prompt_tokens, blocks, demand.alive)
    return running.peak_with(newcomer, size) <= room


class Room:
    """Work conservation for one admission stage: per replica, when its last scrape in a
    discovery round was read and the blocks this instance's requests had written then, and
    the curve of its running requests (made again once CURVE_TTL_S old, or when its ledger
    figure moved)."""

    def __init__(
        self, ledger: Ledger, overcommit: Overcommit, clock: Callable[[], float]
    ) -> None:
        self.ledger, self.overcommit, self.clock = ledger, overcommit, clock
        self._seen: dict[str, tuple[float, int]] = {}
        self._curves: dict[str, tuple[tuple[int, int], float, Curve]] = {}

    def discovered(
        self, replicas: Sequence[Replica], stale_after_s: float, waiting: set[str]
    ) -> Iterator[tuple[Replica, float]]:
        """A discovery round's fresh scrapes (those under `stale_after_s` old): for each,
        what ours had written then, and the replica's overcommit factor steered by it (its
        pool in `waiting`: requests there waited for room since the last round)."""
        ids = {r.id for r in replicas}
        self._seen = {rid: seen for rid, seen in self._seen.items() if rid in ids}
        self._curves = {rid: c for rid, c in self._curves.items() if rid in ids}
        for replica in replicas:
            scrape = replica.fresh_scrape(stale_after_s)
            if scrape is None:
                continue
            self._seen[replica.id] = (scrape.at, replica.written_blocks())
            yield replica, self.overcommit.observe(
                replica.id, preemptions=scrape.preemptions, kv_usage=scrape.kv_usage,
                demand=replica.pool in waiting, waiting=scrape.waiting,
                rejections=scrape.admission_rejections,
                reserved_per_held=self._reserved_per_held(replica, scrape.kv_usage),
            )

    def _reserved_per_held(self, replica: Replica, kv_usage: float | None) -> float | None:
        """The ledger's reserved blocks on `replica` over the blocks its vLLM holds (None
        while it holds none, or its size is unknown)."""
        blocks = replica.num_gpu_blocks
        if not kv_usage or not blocks:
            return None
        return self.ledger.reserved.get(replica.id, 0) / (kv_usage * blocks)

    def limit(self, view: ReplicaView, demand: Demand, limit: int) -> int | None:
        """Where the ledger's `limit` leaves no room for a predicted demand but the replica
        could carry it now (`vllm_room`), the ledger limit at which it fits; else None."""
        blocks = demand.blocks_on(view.replica)
        replica = view.replica
        if (not demand.predicted or view.reserved_blocks + blocks <= limit
                or replica.scrape is None or self.overcommit.strained(view.id)):
            return None
        seen = self._seen.get(view.id)
        written_then = seen[1] if seen is not None and seen[0] == replica.scrape.at else None
        held = self.ledger.exact.get(view.id, 0) + self.ledger.prefixes.held_blocks(view.id)
        if not vllm_room(view, demand, self._curve(view), held, written_then):
            return None
        return view.reserved_blocks + blocks

    def _curve(self, view: ReplicaView) -> Curve:
        """The expected occupancy of this instance's running requests on the replica."""
        now = self.clock()
        key = (view.reserved_blocks, view.block_size)
        cached = self._curves.get(view.id)
        if cached is not None and cached[0] == key and now - cached[1] < CURVE_TTL_S:
            return cached[2]
        replica = view.replica
        curve = Curve(
            holdings((s for s in self.ledger.growing if s.replica is replica), view.block_size),
            view.block_size,
        )
        self._curves[view.id] = (key, now, curve)
        return curve
