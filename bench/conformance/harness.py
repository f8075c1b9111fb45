"""Replay one trace through both engines, step by step, and compare what each step did.

At every step both sides get the same arrivals and aborts, then one engine step. Compared
after it:

- running and waiting counts;
- KV blocks in use;
- which requests were preempted;
- prefix-cache query and hit tokens (the `vllm:prefix_cache_*` counters);
- each request's computed tokens, and the prompt tokens it found cached;
- the requests that finished, in order, with their reasons;
- the free queue, block id by block id: both pools number blocks alike, so equal queues mean
  the same blocks are reused and evicted in the same order.

A replay never stops at the first difference: every step of both runs is compared, so a
report says how large a divergence is, not only where it starts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from conformance.sides import Side, SimSide, StepView, child_ids
from conformance.traces import Trace, TraceRequest

FIELDS = (
    "running", "waiting", "blocks_in_use", "preempted", "hits", "computed", "finished",
    "free_queue", "kv_events",
)  # fmt: skip


@dataclass
class Divergence:
    step: int
    field: str
    vllm: object
    sim: object


@dataclass
class Replay:
    trace: str
    steps: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    finish_order: dict[str, list[str]] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    hit_tokens: dict[str, int] = field(default_factory=dict)
    query_tokens: dict[str, int] = field(default_factory=dict)
    peak_blocks: dict[str, int] = field(default_factory=dict)
    max_block_gap: int = 0
    # the KV cache events each side published, by kind ("stored" counts blocks)
    kv_events: dict[str, Counter[str]] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return not self.divergences

    def steps_differing(self) -> Counter[str]:
        """How many steps differ, per compared field."""
        return Counter(d.field for d in self.divergences)

    def first(self, name: str) -> Divergence | None:
        return next((d for d in self.divergences if d.field == name), None)


def _differences(v: StepView, s: StepView) -> list[tuple[str, object, object]]:
    out: list[tuple[str, object, object]] = []
    for name in ("running", "waiting", "blocks_in_use"):
        if getattr(v, name) != getattr(s, name):
            out.append((name, getattr(v, name), getattr(s, name)))
    if sorted(v.preempted) != sorted(s.preempted):
        out.append(("preempted", sorted(v.preempted), sorted(s.preempted)))
    if (v.query_tokens, v.hit_tokens) != (s.query_tokens, s.hit_tokens):
        out.append(("hits", (v.query_tokens, v.hit_tokens), (s.query_tokens, s.hit_tokens)))
    if dict(v.computed) != dict(s.computed) or dict(v.cached) != dict(s.cached):
        diff = {
            rid: (v.computed.get(rid), s.computed.get(rid))
            for rid in sorted(set(v.computed) | set(s.computed))
            if v.computed.get(rid) != s.computed.get(rid)
        }
        diff.update({
            f"{rid}.cached": (v.cached.get(rid), s.cached.get(rid))
            for rid in sorted(set(v.cached) | set(s.cached))
            if v.cached.get(rid) != s.cached.get(rid)
        })  # fmt: skip
        out.append(("computed", diff, None))
    if v.finished != s.finished:
        out.append(("finished", list(v.finished), list(s.finished)))
    if v.kv_events != s.kv_events:
        out.append(("kv_events", v.kv_events[:6], s.kv_events[:6]))
    if v.free_queue != s.free_queue:
        at = next((i for i, (a, b) in enumerate(zip(v.free_queue, s.free_queue, strict=False)) if a != b),
                  min(len(v.free_queue), len(s.free_queue)))  # fmt: skip
        out.append(("free_queue", v.free_queue[at : at + 8], s.free_queue[at : at + 8]))
    return out


def events(trace: Trace) -> tuple[dict[int, list[TraceRequest]], dict[int, list[str]], int]:
    """The trace's arrivals and aborts by step, and the step of its last event."""
    arrivals: dict[int, list[TraceRequest]] = {}
    aborts: dict[int, list[str]] = {}
    for request in trace.requests:
        arrivals.setdefault(request.arrival_step, []).append(request)
        if request.abort_step is not None:
            aborts.setdefault(request.abort_step, []).extend(child_ids(request))
    return arrivals, aborts, max([*arrivals, *aborts, 0])


def replay(
    trace: Trace,
    make_vllm: Callable[[Trace], Side],
    make_sim: Callable[[Trace], Side] = lambda t: SimSide(t.shape),
) -> Replay:
    sides = (make_vllm(trace), make_sim(trace))
    result = Replay(trace.name)
    for side in sides:
        result.finish_order[side.name] = []
        result.preemptions[side.name] = 0
        result.peak_blocks[side.name] = 0
        result.kv_events[side.name] = Counter()
    arrivals, aborts, last_event = events(trace)
    for step in range(trace.max_steps):
        for side in sides:
            for request in arrivals.get(step, ()):
                side.add(request, step)
            for request_id in aborts.get(step, ()):
                side.abort(request_id)
        if step > last_event and all(side.idle() for side in sides):
            break
        views = [side.step() for side in sides]
        result.steps = step + 1
        for side, view in zip(sides, views, strict=True):
            result.finish_order[side.name].extend(rid for rid, _ in view.finished)
            result.preemptions[side.name] += len(view.preempted)
            result.peak_blocks[side.name] = max(result.peak_blocks[side.name], view.blocks_in_use)
            result.hit_tokens[side.name] = view.hit_tokens
            result.query_tokens[side.name] = view.query_tokens
            for kind, *blocks in view.kv_events:
                result.kv_events[side.name][kind] += max(1, len(blocks))
        v, s = views
        result.max_block_gap = max(result.max_block_gap, abs(v.blocks_in_use - s.blocks_in_use))
        for name, vv, sv in _differences(v, s):
            result.divergences.append(Divergence(step, name, vv, sv))
    return result


@dataclass
class Run:
    """One side alone, from the first arrival until it drained."""

    side: str
    iterations: int = 0
    finish_order: list[str] = field(default_factory=list)
    preemptions: int = 0
    peak_blocks: int = 0
    block_steps: int = 0  # blocks in use summed over iterations
    hit_tokens: int = 0


def run_alone(trace: Trace, side: Side) -> Run:
    """Drive one side through a trace on its own (arrivals and aborts by iteration): for
    sides whose steps do not line up one to one, compared in aggregate."""
    result = Run(side.name)
    arrivals, aborts, last_event = events(trace)
    for step in range(trace.max_steps * 2):
        for request in arrivals.get(step, ()):
            side.add(request, step)
        for request_id in aborts.get(step, ()):
            side.abort(request_id)
        if step > last_event and side.idle():
            break
        view = side.step()
        result.iterations = step + 1
        result.finish_order.extend(rid for rid, _ in view.finished)
        result.preemptions += len(view.preempted)
        result.peak_blocks = max(result.peak_blocks, view.blocks_in_use)
        result.block_steps += view.blocks_in_use
        result.hit_tokens = view.hit_tokens
    return result
