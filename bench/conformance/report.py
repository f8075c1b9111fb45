"""Replay every conformance trace through vLLM's Scheduler and kvgate's simulator; write the
figures to bench/results/conformance.{md,json}.

    ./scripts/conformance --report      (or, inside the conformance virtualenv:
    python bench/conformance/report.py [--out-dir DIR] [--mixed N])
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.harness import FIELDS, Replay, Run, replay, run_alone
from conformance.sides import AsyncVllmSide, SimSide, VllmSide
from conformance.simplifications import SIMPLIFICATIONS
from conformance.traces import TRACES, Trace, mixed

RESULTS = Path(__file__).resolve().parents[1] / "results"


def run(trace: Trace) -> tuple[Trace, Replay]:
    return trace, replay(trace, lambda t: VllmSide(t.shape))


def row(trace: Trace, result: Replay) -> dict[str, object]:
    v, s = "vllm", "kvgate-sim"
    return {
        "trace": trace.name,
        "exercises": trace.exercises,
        "requests": sum(r.n for r in trace.requests),
        "steps": result.steps,
        "equal": result.equal,
        "steps_differing": {name: result.steps_differing().get(name, 0) for name in FIELDS},
        "preemptions": {v: result.preemptions[v], s: result.preemptions[s]},
        "hit_tokens": {v: result.hit_tokens.get(v, 0), s: result.hit_tokens.get(s, 0)},
        "query_tokens": {v: result.query_tokens.get(v, 0), s: result.query_tokens.get(s, 0)},
        "peak_blocks": {v: result.peak_blocks[v], s: result.peak_blocks[s]},
        "finish_order_equal": result.finish_order[v] == result.finish_order[s],
        "max_blocks_gap": result.max_block_gap,
    }


def async_row(trace: Trace) -> dict[str, object]:
    """The synchronous simulator against vLLM's AsyncScheduler: steps no longer line up one to
    one, so the size of the difference is given in aggregate."""
    a: Run = run_alone(trace, AsyncVllmSide(trace.shape))
    s: Run = run_alone(trace, SimSide(trace.shape))
    return {
        "trace": trace.name,
        "iterations": [a.iterations, s.iterations],
        "preemptions": [a.preemptions, s.preemptions],
        "peak_blocks": [a.peak_blocks, s.peak_blocks],
        "mean_blocks": [
            round(a.block_steps / a.iterations, 1),
            round(s.block_steps / s.iterations, 1),
        ],
        "hit_tokens": [a.hit_tokens, s.hit_tokens],
        "finish_order_equal": a.finish_order == s.finish_order,
    }


def markdown(rows: list[dict], mixed_rows: list[dict], async_rows: list[dict], meta: dict) -> str:
    out = [
        "# Simulator conformance: kvgate's engine against vLLM's own V1 Scheduler",
        "",
        f"`{meta['command']}` — {meta['date']}, vLLM {meta['vllm']}, Python {meta['python']},"
        f" {meta['wall_s']:.0f} s.",
        "",
        "Each trace is replayed step by step through `vllm.v1.core.sched.scheduler.Scheduler`"
        " (built offline on a CPU) and `kvgate.sim.engine.Engine`. Compared after every step:"
        " running and waiting counts, KV blocks in use, preemption victims, prefix-cache query"
        " and hit tokens, each request's computed and cached tokens, finished requests in"
        " order, and the free queue block by block. A cell is the number of steps on which"
        " that field differed.",
        "",
        "| trace | exercises | requests | steps | "
        + " | ".join(FIELDS)
        + " | preemptions | hit tokens | peak blocks | verdict |",
        "|---|---|---|---|" + "---|" * len(FIELDS) + "---|---|---|---|",
    ]
    for r in rows:
        p, h, b = r["preemptions"], r["hit_tokens"], r["peak_blocks"]
        out.append(
            f"| {r['trace']} | {r['exercises']} | {r['requests']} | {r['steps']} | "
            + " | ".join(str(r["steps_differing"][f]) for f in FIELDS)
            + f" | {p['vllm']} / {p['kvgate-sim']} | {h['vllm']} / {h['kvgate-sim']}"
            f" | {b['vllm']} / {b['kvgate-sim']} | {'equal' if r['equal'] else 'DIVERGES'} |"
        )
    equal = sum(1 for r in mixed_rows if r["equal"])
    steps = sum(r["steps"] for r in mixed_rows)
    pre = sum(1 for r in mixed_rows if r["preemptions"]["vllm"])
    out += [
        "",
        "Pairs are vLLM / simulator.",
        "",
        f"**Seeded mixed traces** (every feature at once, random engine shapes): {equal} of"
        f" {len(mixed_rows)} equal at every step, {steps} steps in all; {pre} of them preempt.",
        "",
        "## Under vLLM's async scheduling",
        "",
        "vLLM schedules one step ahead by default on GPUs (`AsyncScheduler`, two batches in"
        " flight). The simulator schedules synchronously. Driven as `EngineCore` drives it,"
        " vLLM's steps no longer pair one to one with the simulator's, so the difference is"
        " given in aggregate (async vLLM / simulator):",
        "",
        "| trace | iterations | preemptions | peak blocks | mean blocks | hit tokens"
        " | finish order |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['trace']} | {r['iterations'][0]} / {r['iterations'][1]}"
            f" | {r['preemptions'][0]} / {r['preemptions'][1]}"
            f" | {r['peak_blocks'][0]} / {r['peak_blocks'][1]}"
            f" | {r['mean_blocks'][0]} / {r['mean_blocks'][1]}"
            f" | {r['hit_tokens'][0]} / {r['hit_tokens'][1]}"
            f" | {'same' if r['finish_order_equal'] else 'differs'} |"
            for r in async_rows
        ),
        "",
        "## What the simulator leaves out, and what it costs",
        "",
        "| simplification | vLLM code it departs from | size |",
        "|---|---|---|",
    ]
    for item in SIMPLIFICATIONS:
        out.append(f"| {item.what} | `{item.vllm_code}` | {item.size} |")
    out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--mixed", type=int, default=40, help="seeded mixed traces (40)")
    args = parser.parse_args()
    started = time.monotonic()
    rows = [row(*run(trace)) for trace in TRACES.values()]
    mixed_rows = [row(*run(mixed(seed))) for seed in range(args.mixed)]
    async_rows = [async_row(trace) for trace in TRACES.values()]
    meta = {
        "command": "./scripts/conformance --report",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "vllm": importlib.metadata.version("vllm"),
        "python": platform.python_version(),
        "wall_s": time.monotonic() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "conformance.json").write_text(
        json.dumps(
            {"meta": meta, "traces": rows, "mixed": mixed_rows, "async": async_rows}, indent=1
        )
        + "\n"
    )
    (args.out_dir / "conformance.md").write_text(markdown(rows, mixed_rows, async_rows, meta))
    bad = [r["trace"] for r in (*rows, *mixed_rows) if not r["equal"]]
    print(
        f"{len(rows) + len(mixed_rows) - len(bad)} of {len(rows) + len(mixed_rows)} traces equal"
        + (f"; diverging: {', '.join(bad)}" if bad else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
