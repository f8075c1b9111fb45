"""Several simulated replicas in one process: the fleet file and running it until a signal.

A fleet file is YAML: a list of replicas (or a mapping with a `replicas:` list), each with a
`port`, an optional `host` and `name`, and any `SimConfig` keys (`faults:` a mapping):

    replicas:
      - {name: a, port: 8001, num_gpu_blocks: 2048}
      - {name: long, port: 8003, model_preset: qwen2.5-7b, gpu_mem_gib: 80, max_model_len: 32768}
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.config import SimConfig
from kvgate.sim.server import SimReplica


@dataclass(frozen=True)
class ReplicaSpec:
    config: SimConfig
    port: int
    host: str = "127.0.0.1"
    name: str = ""


class FleetError(ValueError):
    """A fleet file that cannot be used; the message names the entry and key."""


def parse_fleet(data: Any) -> list[ReplicaSpec]:
    entries = data.get("replicas") if isinstance(data, Mapping) else data
    if not isinstance(entries, list) or not entries:
        raise FleetError("a fleet file is a non-empty list of replicas (or `replicas:` list)")
    specs: list[ReplicaSpec] = []
    for index, entry in enumerate(entries):
        where = f"replicas[{index}]"
        if not isinstance(entry, Mapping):
            raise FleetError(f"{where}: must be a mapping")
        entry = dict(entry)
        port, host, name = entry.pop("port", None), entry.pop("host", "127.0.0.1"), entry.pop(
            "name", ""
        )
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise FleetError(f"{where}.port: required, an integer port (0 = any free port)")
        if not isinstance(host, str) or not isinstance(name, str):
            raise FleetError(f"{where}: host and name must be strings")
        try:
            config = SimConfig.from_mapping(entry)
        except ValueError as exc:
            raise FleetError(f"{where}.{exc}") from exc
        specs.append(ReplicaSpec(config, port, host, name or f"replica-{index}"))
    ports = [(s.host, s.port) for s in specs if s.port]
    if len(ports) != len(set(ports)):
        raise FleetError("replicas: two replicas share a host and port")
    return specs


def load_fleet(path: str | Path) -> list[ReplicaSpec]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise FleetError(f"{path}: {exc}") from exc
    return parse_fleet(data)


def describe(replica: SimReplica, name: str = "") -> str:
    """The start-up line: URL and capacity, as vLLM's 'GPU KV cache size' log reports it."""
    cfg = replica.config
    label = f"{name} " if name else ""
    return (
        f"sim {label}{replica.url} model={cfg.served_model_name} "
        f"num_gpu_blocks={cfg.num_gpu_blocks} block_size={cfg.block_size} "
        f"kv_cache_tokens={cfg.kv_cache_tokens} max_model_len={cfg.max_model_len} "
        f"max_concurrency={cfg.max_concurrency:.2f}x time_scale={cfg.time_scale:g}"
    )


async def run_fleet(
    specs: Sequence[ReplicaSpec],
    announce: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
) -> None:
    """Start every replica, announce each, and serve until SIGINT/SIGTERM (or `stop`)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    tokenizer = await asyncio.to_thread(load_tiktoken)
    replicas: list[SimReplica] = []
    try:
        for spec in specs:
            replica = SimReplica(spec.config, tokenizer=tokenizer)
            await replica.start(spec.host, spec.port)
            replicas.append(replica)
            announce(describe(replica, spec.name if len(specs) > 1 else ""))
        await stop.wait()
    finally:
        for replica in replicas:
            await replica.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
