"""The fleet benchmark on two real vLLM engines (vLLM's CPU build, the tiny model), wall-clock.

A sibling of bench/fleet.py rather than a `--vllm` flag on it: fleet.py's machinery is built on
simulated time (time_scale, a fresh simulated fleet of 3 + 1 replicas per run, capacity from
stepping the simulator's engine offline, sim speed), none of which a real engine has. Here two
engines start once (20-40 s) and every run shares them, each run starting on idle engines with
their prefix caches reset (bench/fleetbench/real.py); the contenders, the kvgate config, the
figures and the medians are fleetbench's.

Parts, in the order given (one engine start for all of them):

    capacity   the engines' saturated throughput on the chats, direct round robin, flooded:
               1x load is that many requests per second
    burst      BURST chats within BURST_SPREAD_S s, direct round robin against kvgate-defaults
    loads      open-loop Poisson chats at each --loads multiple of capacity, every contender

Each cell runs --repeats times, the contenders' order reversed every other repeat; medians
reported. Writes <out-dir>/real-fleet-<date>-<parts>.json; `--report FILE...` writes the
markdown (<out-dir>/real-fleet-<date>.md) from one or more of those files.

    .venv/bin/python bench/real_fleet.py [--parts capacity burst loads] [--repeats 3]
        [--loads 1 2] [--contenders direct-rr ...] [--cores pinned|unpinned]
        [--capacity-rate R] [--duration S] [--warmup S] [--ttft-timeout S] [--timeout S]
        [--seed 0] [--out-dir DIR] [--report FILE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from fleetbench import contenders, real, report

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ["direct-rr", "vllm-router-cache_aware", "kvgate-defaults", "kvgate-predicted"]
BURST_CONTENDERS = ["direct-rr", "kvgate-defaults"]
BURST, BURST_SPREAD_S = 98, 2.5
CAPACITY_REQUESTS = 80


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["capacity", "burst", "loads"],
                        choices=["capacity", "burst", "loads"])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loads", nargs="+", type=float, default=[1.0, 2.0])
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS,
                        choices=list(contenders.CONTENDERS))  # fmt: skip
    parser.add_argument("--cores", choices=["pinned", "unpinned"], default="pinned",
                        help="engines on a core each (taskset, one OMP thread), or both on both")
    parser.add_argument("--capacity-rate", type=float,
                        help="1x in requests per second, instead of measuring it")
    parser.add_argument("--duration", type=float, default=24.0,
                        help="seconds of counted arrivals per load run (24)")
    parser.add_argument("--warmup", type=float, default=6.0,
                        help="seconds of arrivals first, not counted (6)")
    parser.add_argument("--ttft-timeout", type=float, default=20.0,
                        help="load runs: seconds a request may wait for its first token (20)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a request may take in all (120)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--report", nargs="+", type=Path, metavar="FILE",
                        help="measure nothing: write the markdown from these results files")
    return parser.parse_args(argv)


def plan(args: argparse.Namespace, rate: float | None) -> list[real.Run]:
    runs = []
    for repeat in range(args.repeats):
        flip = repeat % 2 == 1
        if "burst" in args.parts:
            items = real.build_burst(args.seed + repeat, BURST, BURST_SPREAD_S)
            for name in BURST_CONTENDERS[::-1] if flip else BURST_CONTENDERS:
                runs.append(real.Run("burst", 0.0, contenders.CONTENDERS[name], repeat, items,
                                     0.0, BURST_SPREAD_S, None, args.timeout))  # fmt: skip
        if "loads" in args.parts:
            assert rate is not None
            for load in args.loads:
                items = real.build_chats(args.seed + repeat, args.warmup + args.duration,
                                         load * rate)  # fmt: skip
                for name in args.contenders[::-1] if flip else args.contenders:
                    runs.append(real.Run("load", load, contenders.CONTENDERS[name], repeat,
                                         items, args.warmup, args.duration,
                                         args.ttft_timeout, args.timeout))  # fmt: skip
    return runs


async def measure_all(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    this = asyncio.current_task()
    assert this is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
    out: dict[str, Any] = {"capacity": None, "runs": []}
    began = time.monotonic()
    async with real.engines(args.cores) as engines:
        out["engine_start_s"] = round(time.monotonic() - began, 1)
        print(f"engines ready in {out['engine_start_s']} s ({args.cores})", flush=True)
        rate = args.capacity_rate
        if "capacity" in args.parts:
            out["capacity"] = await real.capacity(engines, args.seed + 1000, CAPACITY_REQUESTS)
            rate = rate or out["capacity"]["requests_per_s"]
            print(f"capacity: {out['capacity']}", flush=True)
        specs = plan(args, rate)
        out["rate_1x_per_s"] = rate
        for n, spec in enumerate(specs, 1):
            record = await real.run(spec, engines, logs / f"{n}")
            record["rate_per_s"] = None if rate is None else round(spec.load * rate, 3)
            out["runs"].append(record)
            print(f"[{n}/{len(specs)}] {progress(record)}", flush=True)
        if "loads" in args.parts and "capacity" in args.parts:  # did the engines slow down?
            out["capacity_after"] = await real.capacity(engines, args.seed + 1000,
                                                        CAPACITY_REQUESTS)  # fmt: skip
            print(f"capacity after: {out['capacity_after']}", flush=True)
    return out


def progress(r: dict[str, Any]) -> str:
    head = f"{r['workload']} {r['load']:g}x {r['contender']:24} r{r['repeat']}"
    if "error" in r:
        return f"{head} not measured: {r['error'].splitlines()[0]}"
    return (f"{head} {r['completed']}/{r['requests']} done, refused {r['refused']}, failed "
            f"{r['failed']}, ttft p50 {r['ttft_s']['short']['p50']} p99 "
            f"{r['ttft_s']['short']['p99']}, goodput@2s {r['goodput_per_s']['short_ttft_2s']}, "
            f"preempt {r['preemptions']}, makespan {r['makespan_s']} s, "
            f"{r['run']['wall_s']:.0f} s wall, cores {r['run']['cpu']}, quiet wait "
            f"{r['run']['quiet_wait_s']} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        documents = [orjson.loads(p.read_bytes()) for p in args.report]
        day = documents[0]["meta"]["date"].split()[0]
        path = args.out_dir / f"real-fleet-{day}.md"
        path.write_text(markdown(documents, [p.name for p in args.report]))
        print(path.read_text())
        return 0
    started, load_before = time.time(), " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="kvgate-real-fleet-") as logs:
        try:
            measured = asyncio.run(measure_all(args, Path(logs)))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("interrupted; the engines and every child process were stopped", file=sys.stderr)
            return 130
    meta = {
        "command": ".venv/bin/python bench/real_fleet.py " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out_dir", "report")},
        "engines": {"count": 2, "num_blocks": real.NUM_BLOCKS, "block_size": real.BLOCK_SIZE,
                    "cores": args.cores, "spec": repr(real.specs(args.cores)[0])},
        "contenders": {n: contenders.CONTENDERS[n].describe
                       for n in dict.fromkeys([*BURST_CONTENDERS, *args.contenders])},
        "workload": real.CHATS.describe,
        "machine": {"cpus": os.cpu_count(), "load_before": load_before,
                    "system": f"{platform.system()} {platform.release()} {platform.machine()}",
                    "python": platform.python_version()},
    }  # fmt: skip
    document = {"meta": meta, **measured, "results": report.medians(measured["runs"])}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"real-fleet-{meta['date'].split()[0]}-{'-'.join(args.parts)}.json"
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    print(table(document["results"]))
    print(f"wrote {path}")
    return 0


COLUMNS = [("done/sent", lambda r: f"{r['completed']}/{r['requests']}"),
           ("refused", lambda r: report.cell(r, ("refused",), "{}")),
           ("failed", lambda r: report.cell(r, ("failed",), "{}")),
           ("TTFT p50/p99 s", lambda r: report.cell(r, ("ttft_s", "short"), "pair")),
           ("goodput@2s /s", lambda r: f"{r['goodput_per_s']['short_ttft_2s']:.2f}"),
           ("out tok/s", lambda r: f"{r['output_tokens_per_makespan_s']:.0f}"),
           ("preempt", lambda r: f"{r['preemptions']:g}"),
           ("makespan s", lambda r: f"{r['makespan_s']:.1f}"),
           ("vip TTFT p50/p99 s", lambda r: report.cell(r, ("ttft_s", "critical"), "pair"))]  # fmt: skip
BURST_COLUMNS = [("done/sent", lambda r: f"{r['completed']}/{r['requests']}"),
                 ("makespan s", lambda r: f"{r['makespan_s']:.1f}"),
                 ("TTFT p50/p99 s", lambda r: report.cell(r, ("ttft_s", "short"), "pair")),
                 ("preempt", lambda r: f"{r['preemptions']:g}"),
                 ("out tok/s", lambda r: f"{r['output_tokens_per_makespan_s']:.0f}"),
                 ("answer tokens mean", lambda r: f"{r['output_tokens_mean']:.0f}")]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown tables: the burst, then the loads (rows by load, contenders as listed)."""
    lines = []
    for part, columns in (("burst", BURST_COLUMNS), ("load", COLUMNS)):
        mine = [r for r in rows if r["workload"] == part]
        if not mine:
            continue
        mine.sort(key=lambda r: (r["load"], CONTENDERS.index(r["contender"])
                                 if r["contender"] in CONTENDERS else 99))  # fmt: skip
        head = ["load", "contender", "n", *(name for name, _ in columns)]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in mine:
            cells = (["—"] * len(columns) if "error" in r else [f(r) for _, f in columns])
            load = "burst" if part == "burst" else f"{r['load']:g}x"
            lines.append(f"| {load} | {r['contender']} | {r['repeats']} | " + " | ".join(cells)
                         + " |")
        lines.append("")
    return "\n".join(lines)


HOW = """\
How it was measured: two vLLM 0.32 CPU engines (`kvgate.tools.vllm_cpu`), each 256 blocks of 32
tokens (8,192 tokens of KV), max_num_seqs 64, max_num_batched_tokens 2,048, prefix caching on,
eager, serving the 2-layer random-weights `tiny-llama`; started once per invocation and shared
by every run, each run starting on idle engines whose prefix caches were reset. Cores: the
machine has 2; each engine is pinned to one (`taskset`, one OMP thread), and the load
generator (this process), kvgate or vllm-router float over both, taking time from the engines.
Chats: 10% vip (critical), the rest chat-app (standard), prompts about 100-300 tokens (p50 234
as the engines count them), max_tokens 1,024, answers end on the model's EOS (geometric, about
384 tokens on average; unseeded, so lengths differ from run to run). Loads: Poisson at a
multiple of 1x, 6 s of warm-up arrivals (sent, not counted) then 24 s counted; a request
without its first token after 20 s is cancelled (failed: timeout), none may take over 120 s.
The burst: 98 chats of about 150 prompt tokens at uniform times within 2.5 s, no first-token
timeout. Figures: done/sent, refused, failed, TTFT (completed requests, wall s) and goodput
(counted requests that completed with their first token within 2 s, per second of the 24 s
of counted arrivals) are of the counted requests; out tok/s (completed output tokens per
second of makespan), preempt (`vllm:num_preemptions_total` summed over both engines) and
makespan (first send to the last completed answer) are of the whole run. Each figure is the
median over repeats on its own (a row's figures may come from different repeats); the
contenders' order is reversed every other repeat. Contenders: """


def markdown(documents: list[dict[str, Any]], names: list[str]) -> str:
    lines = ["# Fleet benchmark on two real vLLM engines (CPU build, tiny model)", ""]
    for doc, name in zip(documents, names, strict=True):
        meta = doc["meta"]
        lines += [f"## `{meta['command']}`", "",
                  f"{meta['date']}, {meta['wall_s']:.0f} s of wall time; {name}; "
                  f"{meta['machine']['cpus']} cores (load average before: "
                  f"{meta['machine']['load_before']}); engines {meta['engines']['cores']}; "
                  f"{meta['settings']['repeats']} repeat(s), medians.", ""]  # fmt: skip
        for key in ("capacity", "capacity_after"):
            if doc.get(key):
                c = doc[key]
                lines.append(f"- {key.replace('_', ' ')}: **{c['requests_per_s']:.2f} requests/s** "
                             f"({c['output_tokens_per_s']:.0f} output tokens/s, "
                             f"{c['preemptions']} preemptions, answers {c['output_tokens_mean']:.0f} "
                             f"tokens on average, prompts p50 {c['prompt_tokens_p50']}); "
                             f"{c['method']}")  # fmt: skip
        if doc.get("rate_1x_per_s"):
            lines.append(f"- 1x = {doc['rate_1x_per_s']:.2f} requests/s")
        foreign = [r["run"]["cpu"]["foreign_cores"] for r in doc["runs"]
                   if "cpu" in r.get("run", {})]  # fmt: skip
        if foreign:
            lines.append(f"- cores busy with other users' processes during a run: at most "
                         f"{max(foreign):.2f}, median {statistics.median(foreign):.2f}")
        lines += ["", table(doc["results"]), repeats(doc["runs"]), ""]
    lines += ["", HOW + "; ".join(f"`{n}` — {d}" for n, d in DESCRIBE.items()) + ".", ""]
    return "\n".join(lines)


DESCRIBE = {
    "direct-rr": "the load generator round-robins straight over the two engines, no gateway",
    "vllm-router-cache_aware": "`vllm-router --policy cache_aware` over both engines",
    "kvgate-defaults": "`kvgate serve` (one process) whose config names the two engines, the "
                       "tiny model's tokenizer and the benchmark's tenants (trusted header), "
                       "and nothing about admission: predicted, no latency targets, "
                       "max_wait_s 60 s",
    "kvgate-predicted": "the same with fleetbench's per-class targets (its `targets` "
                        "contender): queue.ttft_target_s critical 30 s, standard 2 s, "
                        "sheddable 1 s, max_wait_s 30 s, max_depth 1,024",
}  # fmt: skip


def repeats(runs: list[dict[str, Any]]) -> str:
    """Every repeat's TTFT p50, goodput, preemptions and makespan, by cell: the spread the
    medians hide."""
    cells: dict[tuple[str, float, str], list[str]] = {}
    for r in runs:
        if "error" in r:
            continue
        cells.setdefault((r["workload"], r["load"], r["contender"]), []).append(
            f"{r['ttft_s']['short']['p50']:.2f} s / {r['goodput_per_s']['short_ttft_2s']:.2f} / "
            f"{r['preemptions']} / {r['makespan_s']:.1f} s")
    lines = ["| cell | contender | each repeat: TTFT p50 / goodput@2s / preempt / makespan |",
             "|---|---|---|"]
    for (part, load, name), values in cells.items():
        where = "burst" if part == "burst" else f"{load:g}x"
        lines.append(f"| {where} | {name} | " + "; ".join(values) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
