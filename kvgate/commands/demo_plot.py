"""`kvgate demo --workload --plot DIR`: what the demo measured, as pictures (matplotlib).

- `kv-<replica>.png`: one replica's KV cache over the predicted-admission run, as kvgate sees
  it — blocks reserved on its ledger, blocks its requests have written — beside vLLM's own
  usage gauge as scraped (it lags by up to a discovery interval) and the blocks the simulated
  replica really holds, with the admissible limit. The picture behind "26% while nothing fits".
- `ttft-cdf.png`: the CDF of short requests' time to first token, straight to the replicas
  (no admission) and through kvgate in each admission mode, in simulated seconds, over all
  short requests: a refused request never gets a first token, so its curve stops short of 1.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLE_EVERY_S = 0.05  # wall seconds


@dataclass(frozen=True, slots=True)
class KvSample:
    t: float  # simulated seconds since the run began
    reserved: int
    written: int
    vllm_reported: float | None  # blocks, from the scraped usage ratio
    held: int  # the simulator's own count of blocks in use
    admissible: int | None
    limit: int | None  # what predicted reservations may fill: admissible × overcommit
    total: int | None


async def record_kv(gateway: Any, replica_id: str, sim: Any, time_scale: float,
                    into: list[KvSample]) -> None:
    """Sample one replica every SAMPLE_EVERY_S until cancelled."""
    started = time.monotonic()
    while True:
        view = next((v for v in gateway.view.take(gateway.current()) if v.id == replica_id), None)
        if view is not None:
            pool = sim.engine.pool
            total = view.num_gpu_blocks
            reported = view.kv_usage * total if view.kv_usage is not None and total else None
            into.append(KvSample(
                (time.monotonic() - started) / (time_scale or 1.0), view.reserved_blocks,
                view.written_blocks, reported, pool.num_gpu_blocks - pool.num_free_blocks,
                view.admissible_blocks, view.limit(True), total,
            ))
        await asyncio.sleep(SAMPLE_EVERY_S)


def plot(directory: Path, replica: str, samples: Sequence[KvSample],
         ttfts: Mapping[str, Sequence[float | None]]) -> list[Path]:
    """Write both pictures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(9, 5.5))
    t = [s.t for s in samples]
    ax.plot(t, [s.reserved for s in samples], label="reserved (kvgate ledger)")
    ax.plot(t, [s.written for s in samples], label="written (kvgate's estimate)")
    ax.plot(t, [s.held for s in samples], label="held (the replica's own count)", alpha=0.7)
    reported = [(s.t, s.vllm_reported) for s in samples if s.vllm_reported is not None]
    if reported:
        ax.step([x for x, _ in reported], [y for _, y in reported], where="post",
                label="vLLM-reported (scraped usage)", linestyle=":")
    limits = [s.admissible for s in samples if s.admissible is not None]
    if limits:
        ax.axhline(limits[-1], color="red", linestyle="--",
                   label="admissible (target_utilization × blocks)")
    ax.step(t, [math.nan if s.limit is None else s.limit for s in samples], where="post",
            color="red", alpha=0.4, label="predicted limit (× overcommit, from preemptions)")
    if samples and samples[-1].total:
        ax.axhline(samples[-1].total, color="black", linewidth=0.8, label="the replica's blocks")
    ax.set(xlabel="simulated seconds", ylabel="KV blocks",
           title=f"KV cache of {replica} under kvgate (predicted admission)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize="small")
    path = directory / f"kv-{replica}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in ttfts.items():
        ordered = sorted(v for v in values if v is not None)
        if ordered:
            refused = len(values) - len(ordered)
            ax.step(ordered, [(i + 1) / len(values) for i in range(len(ordered))],
                    where="post", label=f"{label} ({refused} of {len(values)} refused)")
    ax.set(xscale="log", xlabel="time to first token, simulated seconds (log)",
           ylabel="share of all short requests",
           title="TTFT of short requests (a refused one never arrives)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    path = directory / "ttft-cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
