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

from conformance.harness import FIELDS, Replay, replay
from conformance.sides import VllmSide
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


def markdown(rows: list[dict], mixed_rows: list[dict], meta: dict) -> str:
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
    meta = {
        "command": "./scripts/conformance --report",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "vllm": importlib.metadata.version("vllm"),
        "python": platform.python_version(),
        "wall_s": time.monotonic() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "conformance.json").write_text(
        json.dumps({"meta": meta, "traces": rows, "mixed": mixed_rows}, indent=1) + "\n"
    )
    (args.out_dir / "conformance.md").write_text(markdown(rows, mixed_rows, meta))
    bad = [r["trace"] for r in (*rows, *mixed_rows) if not r["equal"]]
    print(
        f"{len(rows) + len(mixed_rows) - len(bad)} of {len(rows) + len(mixed_rows)} traces equal"
        + (f"; diverging: {', '.join(bad)}" if bad else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
