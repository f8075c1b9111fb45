"""Request traces for the conformance harness: each one names what it exercises.

A trace is data only. Each request gives its arrival step, its prompt token ids (shared
prefixes are real token ids, so both engines' prefix caches see the same blocks),
`max_tokens`, how many tokens it writes before its end-of-sequence (`stop_after`; None runs
to `max_tokens`), the step at which the client aborts it, `n` and a priority. The engine
settings (`EngineShape`) are part of the trace, so one trace is one experiment.

The prompts come from a seeded generator: token ids in [100, 30000), none of them the
harness's end-of-sequence id.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from conformance.shape import EngineShape


@dataclass(frozen=True)
class TraceRequest:
    id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    stop_after: int | None = None  # output tokens written, EOS included; None: max_tokens
    abort_step: int | None = None
    n: int = 1
    priority: int = 0


@dataclass(frozen=True)
class Trace:
    name: str
    exercises: str
    shape: EngineShape
    requests: tuple[TraceRequest, ...]
    max_steps: int = 4000  # a bound, never reached by a trace that drains
    notes: tuple[str, ...] = field(default=())


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 30000) for _ in range(n))


def underload() -> Trace:
    """A light load: every request is admitted at once, nothing waits, nothing is preempted."""
    rng = random.Random(1)
    requests = tuple(
        TraceRequest(f"r{i}", arrival_step=3 * i, prompt=_tokens(rng, rng.randrange(20, 120)),
                     max_tokens=64, stop_after=rng.randrange(8, 64))
        for i in range(12)
    )  # fmt: skip
    return Trace("underload", "light load: admission, decode and finish, no contention",
                 EngineShape(num_gpu_blocks=257), requests)  # fmt: skip


def shared_system_prompt() -> Trace:
    """Chats that share a 200-token system prompt: later ones hit its cached blocks."""
    rng = random.Random(2)
    system = _tokens(rng, 200)
    requests = tuple(
        TraceRequest(f"r{i}", arrival_step=2 * i, prompt=system + _tokens(rng, rng.randrange(5, 60)),
                     max_tokens=48, stop_after=rng.randrange(4, 48))
        for i in range(16)
    )  # fmt: skip
    return Trace("shared_system_prompt", "prefix-cache hits on a shared system prompt",
                 EngineShape(num_gpu_blocks=257), requests)  # fmt: skip


def overload_preemption() -> Trace:
    """More decode than the pool holds: vLLM preempts the newest running request, recomputes."""
    rng = random.Random(3)
    requests = tuple(
        TraceRequest(f"r{i}", arrival_step=i, prompt=_tokens(rng, rng.randrange(40, 200)),
                     max_tokens=400, stop_after=rng.choice([None, rng.randrange(150, 400)]))
        for i in range(20)
    )  # fmt: skip
    return Trace("overload_preemption", "a pool too small for the decodes: preemption, recompute",
                 EngineShape(num_gpu_blocks=129, max_model_len=1024), requests)  # fmt: skip


def chunked_prefill() -> Trace:
    """Long prompts split across steps by max_num_batched_tokens, beside short decodes."""
    rng = random.Random(4)
    requests = tuple(
        TraceRequest(f"r{i}", arrival_step=4 * i,
                     prompt=_tokens(rng, rng.choice([1500, 2600, 90, 40, 3000, 700])),
                     max_tokens=32, stop_after=rng.randrange(10, 32))
        for i in range(10)
    )  # fmt: skip
    return Trace("chunked_prefill", "long prompts chunked by max_num_batched_tokens=512",
                 EngineShape(num_gpu_blocks=513, max_num_batched_tokens=512), requests)  # fmt: skip


def max_num_seqs_limit() -> Trace:
    """Plenty of blocks, but at most 4 running: the fifth waits for a slot, not for blocks."""
    rng = random.Random(5)
    requests = tuple(
        TraceRequest(f"r{i}", arrival_step=0, prompt=_tokens(rng, 30),
                     max_tokens=40, stop_after=rng.randrange(5, 40))
        for i in range(12)
    )  # fmt: skip
    return Trace("max_num_seqs", "max_num_seqs=4 as the binding limit",
                 EngineShape(num_gpu_blocks=257, max_num_seqs=4), requests)  # fmt: skip


def aborts() -> Trace:
    """Clients that leave mid-prefill (a long prompt in chunks) and mid-decode, and while waiting."""
    rng = random.Random(6)
    requests = (
        TraceRequest("long_abort_prefill", 0, _tokens(rng, 1200), max_tokens=20, abort_step=1),
        TraceRequest("decode_abort", 0, _tokens(rng, 60), max_tokens=100, abort_step=12),
        TraceRequest("stays", 1, _tokens(rng, 80), max_tokens=50, stop_after=30),
        TraceRequest("waiting_abort", 1, _tokens(rng, 900), max_tokens=20, abort_step=2),
        TraceRequest("late", 5, _tokens(rng, 300), max_tokens=30, stop_after=25),
        TraceRequest("decode_abort_2", 6, _tokens(rng, 40), max_tokens=60, abort_step=20),
    )
    return Trace("aborts", "aborts mid-prefill, mid-decode and while waiting",
                 EngineShape(num_gpu_blocks=257, max_num_batched_tokens=256), requests)  # fmt: skip


def parallel_sampling() -> Trace:
    """n > 1: one prompt fanned out into n child requests that share its cached blocks."""
    rng = random.Random(7)
    requests = tuple(
        TraceRequest(f"r{i}", arrival_step=3 * i, prompt=_tokens(rng, rng.randrange(40, 150)),
                     max_tokens=40, stop_after=rng.randrange(10, 40), n=rng.choice([2, 3, 4]))
        for i in range(8)
    )  # fmt: skip
    return Trace("n_gt_1", "n > 1: child requests sharing the prompt's blocks",
                 EngineShape(num_gpu_blocks=257), requests)  # fmt: skip


def priority() -> Trace:
    """The priority policy: the queue orders by (priority, arrival); the victim is the worst."""
    rng = random.Random(8)
    requests = tuple(
        TraceRequest(f"r{i}", arrival_step=i, prompt=_tokens(rng, rng.randrange(40, 160)),
                     max_tokens=300, stop_after=rng.choice([None, rng.randrange(100, 300)]),
                     priority=rng.choice([0, 1, 2, 5]))
        for i in range(18)
    )  # fmt: skip
    return Trace("priority", "--scheduling-policy priority under preemption",
                 EngineShape(num_gpu_blocks=129, max_model_len=1024, policy="priority"),
                 requests)  # fmt: skip


def prefix_eviction() -> Trace:
    """Several shared prefixes cycling through a small pool: cached blocks evicted LRU, tail first."""
    rng = random.Random(9)
    prefixes = [_tokens(rng, 160) for _ in range(5)]
    requests = tuple(
        TraceRequest(f"r{i}", arrival_step=2 * i,
                     prompt=prefixes[rng.randrange(5)] + _tokens(rng, rng.randrange(10, 80)),
                     max_tokens=60, stop_after=rng.randrange(20, 60))
        for i in range(40)
    )  # fmt: skip
    return Trace("prefix_eviction", "prefix-cache eviction under pressure (LRU, tail first)",
                 EngineShape(num_gpu_blocks=65, max_model_len=1024), requests)  # fmt: skip


def mixed(seed: int) -> Trace:
    """Everything at once, drawn from a seed: shared prefixes, chunked long prompts, aborts,
    n > 1, priorities, and a pool small enough to preempt and evict. Not a named scenario:
    a check that the named ones did not miss an interaction."""
    rng = random.Random(1000 + seed)
    policy = rng.choice(["fcfs", "priority"])
    shape = EngineShape(
        num_gpu_blocks=rng.choice([129, 161, 257]),
        max_model_len=2048,
        max_num_seqs=rng.choice([4, 8, 128]),
        max_num_batched_tokens=rng.choice([128, 256, 2048]),
        policy=policy,
    )
    prefixes = [_tokens(rng, rng.choice([16, 48, 100, 200])) for _ in range(3)]
    requests = []
    step = 0
    for i in range(rng.randrange(15, 40)):
        step += rng.choice([0, 0, 1, 2, 5])
        body = _tokens(rng, rng.choice([5, 30, 80, 300, 700]))
        prompt = (rng.choice(prefixes) + body) if rng.random() < 0.6 else body
        max_tokens = rng.choice([8, 40, 150, 300])
        stop_after = rng.choice([None, rng.randrange(1, max_tokens)]) if max_tokens > 1 else None
        requests.append(TraceRequest(
            f"m{i}", step, prompt, max_tokens, stop_after,
            abort_step=step + rng.randrange(0, 30) if rng.random() < 0.15 else None,
            n=rng.choice([1, 1, 1, 2, 3]),
            priority=rng.choice([0, 1, 3]) if policy == "priority" else 0,
        ))  # fmt: skip
    return Trace(f"mixed-{seed}", "seeded mix of every feature", shape, tuple(requests))


TRACES = {
    trace.name: trace
    for trace in (
        underload(),
        shared_system_prompt(),
        overload_preemption(),
        chunked_prefill(),
        max_num_seqs_limit(),
        aborts(),
        parallel_sampling(),
        priority(),
        prefix_eviction(),
    )
}
