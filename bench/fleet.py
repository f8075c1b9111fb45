"""Goodput of kvgate's admission against a bare fleet and vllm-router, on one simulated fleet.

For every workload × load × contender (× repeat) a fresh simulated fleet is started — three
normal replicas and one long-context replica, each its own `kvgate sim` process — then the
contender's process(es), and the same seeded open-loop workload is sent from this process.
Loads are multiples of the fleet's capacity for the workload, estimated once by stepping the
simulator's engine offline (bench/fleetbench/capacity.py). Times are simulated seconds: the
replicas run `--time-scale` wall seconds per simulated second (each workload has its own: as
fast as two cores keep up with), and the load generator's wall clock is divided by it. Contenders' order alternates between repeats; reported figures are
medians over repeats.

Writes bench/results/fleet-<date>.json (every run and the medians), fleet.md (the table and
how it was made, for docs/benchmarks.md), and PNG plots: goodput against load per workload, and the
CDF of short requests' TTFT at 2x load.

    .venv/bin/python bench/fleet.py [--quick] [--repeats N]
        [--workloads mix realistic trace trace-mixed]
        [--loads 0.5 1 2 3] [--contenders direct-rr kvgate-predicted ...]
        [--duration S] [--warmup S] [--ttft-timeout S] [--timeout S] [--time-scale S]
        [--seed 0] [--out-dir DIR] [--from-json FILE] [--ab TREE]

`--ab TREE` also runs each kvgate contender from another checkout (`NAME@base`, e.g. a
`git worktree` of the commit before a change), in the same run: before against after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from fleetbench import capacity, contenders, fleet, measure, report, workloads

ROOT = Path(__file__).resolve().parents[1]
FULL = {"workloads": ["mix", "realistic"], "loads": [0.5, 1.0, 2.0, 3.0],
        "contenders": list(contenders.CONTENDERS)}
QUICK = {"workloads": ["realistic"], "loads": [1.0, 2.0],
         "contenders": ["direct-rr", "vllm-router-cache_aware", "kvgate-worst",
                        "kvgate-predicted", "kvgate-redis-x2"],
         "duration": 32.0, "repeats": 1}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="realistic workload at 1x and 2x, five contenders, shorter runs "
                             "(about 5 minutes)")  # fmt: skip
    parser.add_argument("--repeats", type=int,
                        help="runs of every cell, medians reported (the most the workloads "
                             f"run take: {_each('repeats')})")  # fmt: skip
    parser.add_argument("--workloads", nargs="+", choices=list(workloads.WORKLOADS))
    parser.add_argument("--loads", nargs="+", type=float, help="multiples of capacity")
    parser.add_argument("--contenders", nargs="+", choices=list(contenders.CONTENDERS))
    parser.add_argument("--duration", type=float,
                        help="simulated seconds of counted arrivals per run (the workload's: "
                             f"{_each('duration_s')}; quick 32)")  # fmt: skip
    parser.add_argument("--warmup", type=float,
                        help="simulated seconds of arrivals first, not counted (the workload's: "
                             f"{_each('warmup_s')})")  # fmt: skip
    parser.add_argument("--ttft-timeout", type=float, default=20.0,
                        help="simulated seconds a request may wait for its first token (20)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="simulated seconds a request may take in all (90)")
    parser.add_argument("--time-scale", type=float,
                        help=f"wall seconds per simulated second (the workload's: "
                             f"{_each('time_scale')})")  # fmt: skip
    parser.add_argument("--ab", metavar="TREE",
                        help="also run each kvgate contender from another checkout (NAME@base): "
                             "before against after in one run")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="workload seed of the first repeat")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="measure nothing: write the table, markdown and plots again "
                             "from a results file this command wrote")  # fmt: skip
    args = parser.parse_args(argv)
    profile = QUICK if args.quick else FULL
    for name, value in profile.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.ab:
        args.contenders = [*args.contenders, *(f"{n}@base" for n in args.contenders
                                               if contenders.CONTENDERS[n].kind == "kvgate")]
    if args.repeats is None:
        args.repeats = max(workloads.WORKLOADS[n].repeats for n in args.workloads)
    return args


def _each(setting: str) -> str:
    """Every workload's own value of a run setting, for --help."""
    return ", ".join(f"{n} {getattr(w, setting):g}" for n, w in workloads.WORKLOADS.items())


def run_settings(args: argparse.Namespace, name: str) -> dict[str, float]:
    """Warm-up, duration and time scale for one workload: the flags, else its own."""
    workload = workloads.WORKLOADS[name]
    return {"warmup_s": workload.warmup_s if args.warmup is None else args.warmup,
            "duration_s": workload.duration_s if args.duration is None else args.duration,
            "time_scale": workload.time_scale if args.time_scale is None else args.time_scale}


def plan(args: argparse.Namespace, rates: dict[str, float]) -> list[measure.RunSpec]:
    """Every run in order: repeats outermost, the contenders' order reversed every other
    repeat, so drift on a shared machine falls on all of them alike."""
    specs = []
    for repeat in range(args.repeats):
        order = args.contenders if repeat % 2 == 0 else args.contenders[::-1]
        for name in args.workloads:
            run = run_settings(args, name)
            for load in args.loads:
                for contender in order:
                    specs.append(measure.RunSpec(
                        workloads.WORKLOADS[name], load, round(load * rates[name], 3),
                        contenders.named(contender, args.ab), repeat, args.seed + repeat,
                        run["warmup_s"], run["duration_s"], args.ttft_timeout, args.timeout,
                        run["time_scale"],
                    ))  # fmt: skip
    return specs


async def measure_all(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    this = asyncio.current_task()
    assert this is not None
    # SIGTERM cancels the run; every child process is stopped on the way out.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
    estimates = {}
    for name in args.workloads:
        workload = workloads.WORKLOADS[name]
        nominal = fleet.replicas({n: 0 for n in fleet.REPLICAS}, 1.0, workload.output_lengths)
        estimates[name] = await asyncio.to_thread(capacity.estimate, workload, nominal)
        print(f"capacity of the fleet for {name}: {estimates[name]['requests_per_s']:.2f} "
              f"requests per simulated second ({estimates[name]['bottleneck_pool']} pool "
              "saturates first)", flush=True)  # fmt: skip
    specs = plan(args, {n: e["requests_per_s"] for n, e in estimates.items()})
    runs = []
    for n, spec in enumerate(specs, 1):
        items = spec.workload.build(spec.seed, spec.warmup_s + spec.duration_s, spec.rate_per_s)
        folder = logs / spec.run_id
        folder.mkdir(parents=True)
        record = await measure.run(spec, items, folder)
        runs.append(record)
        print(f"[{n}/{len(specs)}] {progress(record)}", flush=True)
    return {"capacity": estimates, "runs": runs}


def progress(record: dict[str, Any]) -> str:
    head = f"{record['workload']} {record['load']:g}x {record['contender']:24}"
    if "error" in record:
        return f"{head} not measured: {record['error'].splitlines()[0]}"
    good = record["goodput_per_s"]
    return (f"{head} {record['requests']} requests, {record['completed']} done, goodput "
            f"{good['short_ttft_1s']:.2f}/{good['short_ttft_2s']:.2f} per s, "
            f"{record['run']['wall_s']:.0f} s wall, sim speed {record['run']['sim_speed_min']}")


def describe(args: argparse.Namespace, started: float) -> dict[str, Any]:
    return {
        "command": "python bench/fleet.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "profile": "quick" if args.quick else "full",
        "wall_s": round(time.monotonic() - args.monotonic_start, 1),
        "settings": {"workloads": args.workloads, "loads": args.loads,
                     "contenders": args.contenders, "repeats": args.repeats,
                     "per_workload": {n: run_settings(args, n) for n in args.workloads},
                     "ttft_timeout_s": args.ttft_timeout, "timeout_s": args.timeout,
                     "seed": args.seed},
        "contenders": {n: contenders.named(n, args.ab).describe for n in args.contenders},
        "fleet": {name: {**knobs, **fleet.TIMING, **fleet.OVERRIDES.get(name, {})}
                  for name, knobs in fleet.REPLICAS.items()},
        "workloads": {n: workloads.WORKLOADS[n].describe for n in args.workloads},
        "output_lengths": {n: workloads.WORKLOADS[n].output_lengths for n in args.workloads},
        "slo": {"short_ttft_s": list(report.SHORT_TTFT_SLOS_S),
                "long_ttft_s": report.LONG_TTFT_SLO_S},
        "machine": {"cpus": os.cpu_count(), "load_before": args.load_before,
                    "system": f"{platform.system()} {platform.release()} {platform.machine()}",
                    "python": platform.python_version()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        document = orjson.loads(args.from_json.read_bytes())
        write(args.out_dir, document["meta"], document["capacity"], document["runs"])
        return 0
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    args.monotonic_start = time.monotonic()
    started = time.time()
    run: Any = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        run = uvloop.run
    with tempfile.TemporaryDirectory(prefix="kvgate-fleet-") as logs:
        try:
            measured = run(measure_all(args, Path(logs)))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("interrupted; every child process was stopped", file=sys.stderr)
            return 130
    write(args.out_dir, describe(args, started), measured["capacity"], measured["runs"])
    return 0


def write(out: Path, meta: dict[str, Any], estimates: dict[str, Any],
          runs: list[dict[str, Any]]) -> None:  # fmt: skip
    """The JSON, the markdown and the plots under `out`; the table on stdout."""
    rows = report.medians(runs)
    out.mkdir(parents=True, exist_ok=True)
    day = meta["date"].split()[0]
    plots = report.plots(rows, runs, out, f"fleet-{day}")
    document = {"meta": meta, "capacity": estimates, "results": rows, "runs": runs,
                "plots": [p.name for p in plots]}  # fmt: skip
    (out / f"fleet-{day}.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    (out / "fleet.md").write_text(report.markdown(meta, estimates, rows, plots))
    print()
    print(report.table(rows))
    print(report.legend())
    print(f"\nwrote {out / f'fleet-{day}.json'}, {out / 'fleet.md'} and "
          + (", ".join(p.name for p in plots) if plots else
             "no plots: matplotlib is not installed (pip install -e '.[bench]')"))


if __name__ == "__main__":
    sys.exit(main())
