"""The demo's simulated fleet: two normal replicas and one long-context replica of the vLLM
simulator, on loopback (`kvgate demo`; demo_vllm.py is the same fleet as real engines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.sim.config import SimConfig
from kvgate.sim.server import SimReplica

SIM_MODEL = SimConfig.served_model_name  # what the simulator serves
# Sized so the workload overloads the normal replicas: 6,400 tokens of KV each.
FLEET: dict[str, dict[str, Any]] = {
    "normal-a": dict(num_gpu_blocks=400, max_model_len=4096, seed=1),
    "normal-b": dict(num_gpu_blocks=400, max_model_len=4096, seed=2),
    "long": dict(num_gpu_blocks=2400, max_model_len=16384, max_num_batched_tokens=8192, seed=3),
}
# Answers use 60-100% of max_tokens: near the worst case, where overload makes vLLM preempt.
OUTPUT_LEN_DIST, OUTPUT_LEN_MIN_FRACTION = "uniform", 0.6


@dataclass
class SimFleet:
    """The simulated replicas by name, with the face a RealFleet has."""

    replicas: dict[str, SimReplica]
    model: str = SIM_MODEL

    def url(self, name: str) -> str:
        return self.replicas[name].url

    def tokenizer_file(self) -> str | None:
        return None  # the simulator counts with cl100k, kvgate's default

    async def stats(self) -> dict[str, dict[str, Any]]:
        return replica_stats(self.replicas)

    def describe(self) -> list[str]:
        return [f"  {name:9} {r.url}  {r.config.num_gpu_blocks} blocks, "
                f"max_model_len {r.config.max_model_len}" for name, r in self.replicas.items()]


async def start_fleet(tokenizer: Any, time_scale: float) -> dict[str, SimReplica]:
    fleet = {}
    for name, knobs in FLEET.items():
        config = SimConfig(**knobs, time_scale=time_scale, output_len_dist=OUTPUT_LEN_DIST,
                           output_len_min_fraction=OUTPUT_LEN_MIN_FRACTION)
        replica = SimReplica(config, tokenizer=tokenizer)
        await replica.start()
        fleet[name] = replica
    return fleet


async def stop_fleet(fleet: dict[str, SimReplica]) -> None:
    for replica in fleet.values():
        await replica.stop()


def replica_stats(fleet: dict[str, SimReplica]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, replica in fleet.items():
        stats = replica.engine.stats
        queries = stats.prefix_cache_queries
        out[name] = {
            "finished": stats.finished,
            "preemptions": stats.num_preemptions,
            "prefix_hit_rate": round(stats.prefix_cache_hits / queries, 3) if queries else None,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "prefix_cache_queries": queries,
        }
    return out
