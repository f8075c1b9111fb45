"""The simulated fleet: three normal replicas and one long-context replica.

Each replica is its own `kvgate sim --fleet FILE` process (one vLLM per GPU), from a one-entry
fleet YAML written here. The replicas model a 70B-class model served with tensor parallelism
(about 25 ms of fixed cost per engine step, 0.15 ms per prefill token, 0.5 ms per decoding
sequence: ~30 tokens/s per sequence at a batch of 16) rather than the simulator's default 7B:
every simulated token is streamed over real sockets through the contender to the load
generator, all on two shared cores, and a slower model keeps that stream — not the model
being simulated — from setting the pace. `time_scale` then compresses time as far as the
machine allows (`measure.py` checks, from each replica's simulated clock, that it kept up).

The normal replicas' KV cache (1,280 blocks, 20,480 tokens) holds about four chats at their
worst case (prompt + max_tokens up to 8,192) and twenty at what they really use: the gap that
admission on predicted demand is meant to use. The long-context replica (8,192 blocks,
max_model_len 32,768) is a larger, faster group of GPUs, so the normal pool saturates first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

NORMAL = ("normal-a", "normal-b", "normal-c")
LONG = "long"
TIMING: dict[str, float] = {"step_overhead_s": 0.025, "prefill_token_s": 0.00015,
                            "decode_seq_s": 0.0005}  # fmt: skip
REPLICAS: dict[str, dict[str, Any]] = {
    **{name: {"num_gpu_blocks": 1280, "max_model_len": 8192, "max_num_batched_tokens": 2048,
              "seed": i + 1} for i, name in enumerate(NORMAL)},
    LONG: {"num_gpu_blocks": 8192, "max_model_len": 32768, "max_num_batched_tokens": 8192,
           "seed": 9},
}  # fmt: skip
# The long-context replica runs on a larger, faster group of GPUs (more KV, quicker prefill),
# so that the normal pool is what saturates first under both workloads.
OVERRIDES: dict[str, dict[str, float]] = {
    LONG: {"step_overhead_s": 0.012, "prefill_token_s": 0.00004, "decode_seq_s": 0.0002},
}


@dataclass(frozen=True, slots=True)
class Replica:
    name: str
    pool: str  # "default" or "long", as kvgate's config names them
    port: int
    settings: dict[str, Any]  # SimConfig keys
    # where it publishes its KV cache events, as kvgate's replica `kv_events` names them
    kv_events: dict[str, str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def replicas(ports: dict[str, int], time_scale: float, output_lengths: dict[str, Any],
             seed: int = 0, events_ports: dict[str, tuple[int, int]] | None = None,
             ) -> list[Replica]:  # fmt: skip
    """The fleet's replicas on the given ports; `seed` shifts every replica's own seed;
    `events_ports`: (publisher, replay) per replica, where each publishes vLLM's KV events."""
    fleet = []
    for name, knobs in REPLICAS.items():
        settings = {**knobs, **TIMING, **OVERRIDES.get(name, {}), **output_lengths,
                    "time_scale": time_scale,
                    "seed": knobs["seed"] + 100 * seed}  # fmt: skip
        endpoints = None
        if events_ports is not None:
            pub, replay = events_ports[name]
            settings["kv_events_config"] = json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"})
            endpoints = {"endpoint": f"tcp://127.0.0.1:{pub}",
                         "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
        pool = "long" if name == LONG else "default"
        fleet.append(Replica(name, pool, ports[name], settings, endpoints))
    return fleet


def fleet_file(replica: Replica, directory: Path) -> Path:
    """A one-replica fleet YAML for `kvgate sim --fleet`."""
    path = directory / f"fleet-{replica.name}.yaml"
    entry = {"name": replica.name, "host": "127.0.0.1", "port": replica.port, **replica.settings}
    path.write_text(yaml.safe_dump({"replicas": [entry]}, sort_keys=False))
    return path


def sim_config(replica: Replica) -> Any:
    """The replica's SimConfig (for the offline capacity estimate)."""
    from kvgate.sim.config import SimConfig

    return SimConfig.from_mapping(replica.settings)
