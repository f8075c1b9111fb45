"""`kvgate sim`: run one simulated vLLM replica from flags, or a fleet from a YAML file.

    kvgate sim --port 8001 --num-gpu-blocks 4096 --time-scale 0.1
    kvgate sim --port 8002 --model-preset qwen2.5-7b --gpu-mem-gib 80 --max-model-len 32768
    kvgate sim --fleet config/fleet.example.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from kvgate.sim.config import OUTPUT_LEN_DISTS, SimConfig
from kvgate.sim.fleet import FleetError, ReplicaSpec, load_fleet, run_fleet
from kvgate.sim.text import TEMPLATE_HELP

# flag dest -> SimConfig field; flags left unset keep SimConfig's defaults.
CONFIG_FLAGS: dict[str, tuple[type, str]] = {
    "num_gpu_blocks": (int, "KV blocks (vLLM's --num-gpu-blocks-override)"),
    "model_preset": (str, "compute blocks from a model preset (kvgate.tools.capacity.PRESETS)"),
    "gpu_mem_gib": (float, "GPU memory in GiB, with --model-preset"),
    "gpu_memory_utilization": (float, "fraction of GPU memory vLLM may use (0.9)"),
    "weights_gib": (float, "model weights in GiB (default: the preset's)"),
    "kv_dtype_bytes": (int, "bytes per KV element: 2 (fp16/bf16) or 1 (fp8)"),
    "block_size": (int, "tokens per KV block (16)"),
    "max_model_len": (int, "maximum prompt + output tokens (8192)"),
    "max_num_seqs": (int, "maximum running requests (256)"),
    "max_num_batched_tokens": (int, "token budget per engine step (2048)"),
    "scheduling_policy": (str, "fcfs or priority (vLLM's --scheduling-policy; fcfs)"),
    "max_num_queued_reqs": (int, "answer 503 beyond this many unfinished requests (no limit)"),
    "max_num_queued_tokens": (int, "answer 503 once prompts in prefill hold this many tokens "
                              "(no limit)"),
    "step_overhead_s": (float, "simulated seconds per step (0.006)"),
    "prefill_token_s": (float, "simulated seconds per prefill token (0.00008)"),
    "decode_seq_s": (float, "simulated seconds per decoding sequence (0.00015)"),
    "time_scale": (float, "wall seconds per simulated second (1.0; 0.1 = 10x faster)"),
    "output_len_dist": (str, f"output length: one of {', '.join(OUTPUT_LEN_DISTS)} (max)"),
    "output_len_min_fraction": (float, "uniform: lowest fraction of max_tokens (0.1)"),
    "output_len_median_fraction": (float, "lognormal: median fraction of max_tokens (0.3)"),
    "output_len_sigma": (float, "lognormal: sigma (0.8)"),
    "seed": (int, "seed of the output lengths and chance faults (0)"),
    "served_model_name": (str, "the model name clients must use (sim-model)"),
    "api_key": (str, "require 'Authorization: Bearer KEY' on /v1 paths"),
    "kv_events_config": (str, "publish KV cache events, as vLLM's --kv-events-config JSON "
                         "(endpoint tcp://*:0 picks a free port)"),
    "data_parallel_rank": (int, "serve as this data-parallel rank: its `engine` label, and KV "
                           "events at the endpoints' ports + the rank (0)"),
}
FAULT_FLAGS: dict[str, tuple[type, str]] = {
    "latency_s": (float, "seconds to wait before answering each /v1 request"),
    "error_rate": (float, "fraction of /v1 requests answered 500"),
    "drop_after_chunks": (int, "drop the connection after N streamed chunks"),
    "drop_rate": (float, "fraction of requests the drop applies to (1.0)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = TEMPLATE_HELP  # clients comparing token counts need to know it
    parser.add_argument("--fleet", metavar="FILE", help="run every replica of a fleet YAML file")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on (8001)")
    group = parser.add_argument_group("replica")
    for dest, (kind, text) in CONFIG_FLAGS.items():
        group.add_argument(f"--{dest.replace('_', '-')}", dest=dest, type=kind, help=text)
    group.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    group.add_argument(
        "--no-scheduler-reserve-full-isl", action="store_true",
        help="admit a waiting request when its first chunk fits, not its whole prompt",
    )
    faults = parser.add_argument_group("faults")
    for name, (kind, text) in FAULT_FLAGS.items():
        faults.add_argument(f"--fault-{name.replace('_', '-')}", dest=f"fault_{name}",
                            type=kind, help=text)  # fmt: skip
    faults.add_argument("--fault-hang", action="store_true", help="never answer /v1 requests")
    faults.add_argument("--fault-health-fail", action="store_true", help="/health answers 503")


def replica_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The SimConfig keys the flags set (a mapping for `SimConfig.from_mapping`)."""
    values: dict[str, Any] = {
        dest: getattr(args, dest) for dest in CONFIG_FLAGS if getattr(args, dest) is not None
    }
    if args.no_prefix_caching:
        values["enable_prefix_caching"] = False
    if args.no_scheduler_reserve_full_isl:
        values["reserve_full_prompt"] = False
    faults: dict[str, Any] = {
        name: getattr(args, f"fault_{name}")
        for name in FAULT_FLAGS
        if getattr(args, f"fault_{name}") is not None
    }
    if args.fault_hang:
        faults["hang"] = True
    if args.fault_health_fail:
        faults["health_fail"] = True
    if faults:
        values["faults"] = faults
    return values


def run(args: argparse.Namespace) -> int:
    try:
        specs = _specs(args)
    except (FleetError, ValueError) as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    runner = _event_loop_runner()
    try:
        runner(run_fleet(specs, announce=lambda line: print(line, flush=True)))
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # the port is taken, the host does not resolve, ...
        print(f"kvgate sim: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def _specs(args: argparse.Namespace) -> list[ReplicaSpec]:
    overrides = replica_overrides(args)
    if args.fleet:
        if overrides:
            raise ValueError("--fleet takes every replica setting from the file; drop the flags")
        return load_fleet(args.fleet)
    if "model_preset" in overrides and "num_gpu_blocks" in overrides:
        raise ValueError("give --num-gpu-blocks or --model-preset, not both")
    return [ReplicaSpec(SimConfig.from_mapping(overrides), args.port, args.host)]


def _event_loop_runner() -> Any:
    """uvloop's runner where installed (the simulator's hot path is the event loop)."""
    with contextlib.suppress(ImportError):
        import uvloop

        return uvloop.run
    return asyncio.run
