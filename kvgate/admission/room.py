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
and was not one where vLLM preempted or refused a request at its queue limits; and the peak
of what kvgate's requests there will hold (`peak_blocks`), with this one among them, fits in
what is left of the cache after the blocks others hold (vLLM's usage at the scrape less what
kvgate's own requests had written then), vLLM's watermark, and the blocks kept for the
critical class where the request is of a lower class.

The peak: every running request writes on at the same pace until it has written what it is
expected to (its reservation), then frees all it holds. A burst of young requests reaches
its peak when they all near their ends, at the sum of their reservations, as the ledger
counts them; requests at staggered stages peak far lower, as some end while others grow.
A worst-case reservation holds all it reserved throughout. Preemption stays an overload
signal: a replica that preempted since its previous scrape is closed to this path until a
scrape shows none, and the ledger, steered by `kvgate.admission.overcommit`, decides alone.
Worst-case requests never use this path: their guarantee is the ledger's.

Pure arithmetic; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.admission.demand import Demand, Slot
    from kvgate.fleet.snapshot import ReplicaView

# vLLM keeps this share of its blocks free when it starts a request (its scheduler's
# watermark, 1%); work conservation keeps it too.
WATERMARK = 0.01


def holdings(slots: Iterable[Slot], block_size: int) -> list[tuple[int, int]]:
    """(blocks written now, blocks still to write) of each of this instance's predicted
    reservations on one replica: what it has written, and up to its reservation, the answer
    it is expected to write (one not sent yet has written nothing)."""
    out = []
    for slot in slots:
        if slot.released:
            continue
        written = 0 if slot.progress is None else math.ceil(slot.progress() / block_size)
        written = min(written, slot.reserved_blocks)
        out.append((written, slot.reserved_blocks - written))
    return out


def peak_blocks(running: list[tuple[int, int]]) -> int:
    """The most the `running` requests ((written, to write) blocks each) hold at once, if all
    write on at one pace and each frees what it holds when it has written all it will: at
    each request's end, those still running hold what they had plus what they wrote since."""
    if not running:
        return 0
    ends = sorted(running, key=lambda held: held[1])
    # those alive at step p: the ones whose end is at or after p (they hold written + p)
    count, written = len(ends), sum(w for w, _ in ends)
    peak = 0
    for w, left in ends:  # just before this one ends, everyone from it onwards runs
        peak = max(peak, written + count * left)
        count, written = count - 1, written - w
    return peak


def others_blocks(view: ReplicaView, written_then: int | None) -> int:
    """Blocks vLLM held at its last scrape for requests this instance did not send (other
    instances', clients that bypass kvgate): its usage less what ours had written then
    (`written_then`; None: unknown, so all of its usage), never below 0."""
    assert view.kv_usage is not None and view.num_gpu_blocks
    used = math.ceil(view.kv_usage * view.num_gpu_blocks)
    return max(0, used - (written_then if written_then is not None else 0))


def vllm_room(
    view: ReplicaView, demand: Demand, running: list[tuple[int, int]], exact: int,
    written_then: int | None,
) -> bool:
    """Whether the replica could carry the demand now besides `running` (`holdings` of this
    instance's predicted reservations there) and `exact` (its worst-case ones), by its own
    vLLM figures (see the module docstring). False when those cannot say: no fresh scrape,
    its size or usage unknown, or requests waiting in its own queue."""
    total = view.num_gpu_blocks
    if not view.scraped or view.kv_usage is None or not total or view.waiting:
        return False
    kept = view.kept_blocks if demand.priority != "critical" else 0
    room = total - math.ceil(WATERMARK * total) - kept - others_blocks(view, written_then) - exact
    blocks = demand.blocks_on(view.replica)
    prompt = math.ceil(demand.prompt_tokens / view.block_size)
    newcomer = (min(prompt, blocks), blocks - min(prompt, blocks))
    return peak_blocks([*running, newcomer]) <= room
