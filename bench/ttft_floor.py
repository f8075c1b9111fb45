"""The TTFT each request of a fleet-benchmark workload gets alone on its pool's replica, warm:
the floor under any admission or routing. A latency target below it cannot be met by a gateway
on that fleet, whatever it does.

Each pool's replica (the benchmark's own settings) is stepped offline, one request at a time,
each aborted at its first token; the shared system prompts stay in its prefix cache, as on a
replica that has served the workload a while. Simulated seconds, the engine's step-cost model.

    .venv/bin/python bench/ttft_floor.py [--workloads trace trace-mixed mix realistic]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleetbench import fleet, workloads
from fleetbench.capacity import SAMPLE_DURATION_S, SAMPLE_RATE, first_token_s, sim_config

from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.engine import Engine
from kvgate.sim.options import output_tokens
from kvgate.sim.text import PromptEncoder
from kvgate.tools.workload import WorkItem


def alone_ttft(engine: Engine, item: WorkItem, n: int, encoder: PromptEncoder) -> float:
    """Simulated seconds from submitting `item` to an idle `engine` to its first token."""
    prompt = encoder.encode_chat(item.body["messages"])
    return first_token_s(engine, f"r{n}", prompt, item.body.get("max_tokens"),
                         output_tokens(item.headers))


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def floors(name: str) -> dict[str, dict[str, float]]:
    workload = workloads.WORKLOADS[name]
    items = workload.build(0, SAMPLE_DURATION_S, SAMPLE_RATE)
    nominal = fleet.replicas({n: 0 for n in fleet.REPLICAS}, 1.0, workload.output_lengths)
    engines = {r.pool: Engine(sim_config(r)) for r in reversed(nominal)}  # one of each pool
    encoder = PromptEncoder(load_tiktoken())
    groups: dict[str, list[float]] = {"short": [], "critical": [], "long": []}
    for n, item in enumerate(items):
        ttft = alone_ttft(engines["long" if item.kind == "long" else "default"], item, n, encoder)
        groups[item.kind].append(ttft)
        if item.tenant == "vip":
            groups["critical"].append(ttft)
    return {group: {"n": len(v), "p50": quantile(v, 0.5), "p99": quantile(v, 0.99),
                    "max": max(v)} for group, v in groups.items() if len(v) >= 2}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(workloads.WORKLOADS),
                        choices=list(workloads.WORKLOADS))  # fmt: skip
    args = parser.parse_args()
    print("| workload | requests | TTFT alone p50 | p99 | max |\n|---|---|---|---|---|")
    for name in args.workloads:
        for group, f in floors(name).items():
            print(f"| {name} {group} | {f['n']} | {f['p50']:.3f} s | {f['p99']:.3f} s "
                  f"| {f['max']:.3f} s |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
