"""What is measured in front of the fleet, each started as its own process(es).

    direct-rr                 no process: the load generator round-robins chats over the normal
                              replicas and sends long documents to the long replica, as a
                              Kubernetes Service per pool would
    vllm-router-<policy>      the `vllm-router` package (Rust), one router per pool, as a
                              router that knows no pools would be deployed; policies
                              round_robin, power_of_two, cache_aware
    kvgate-worst              `kvgate serve`, admission.mode worst_case
    kvgate-predicted          `kvgate serve`, admission.mode predicted
    kvgate-predicted-lookahead  the same with admission.prediction.rule lookahead
    kvgate-events             `kvgate serve`, predicted, routing on the replicas' KV cache events
                              (workloads whose replicas publish them: rag)
    kvgate-defaults           `kvgate serve` with the admission a user who configured nothing
                              gets: predicted, no latency targets, max_wait_s 60 s
    kvgate-redis-x2           two `kvgate serve` sharing state in Redis, predicted; the load
                              generator alternates between them
    kvgate-priority           `kvgate serve`, predicted, in front of replicas that run vLLM's
                              `--scheduling-policy priority` (pools declare it): each class
                              is sent as vLLM's priority

kvgate's settings that are durations (discovery, queue waits) are given in simulated seconds
and multiplied by the fleet's time_scale, so kvgate sees the same time the replicas do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvgate.config import QueueConfig

from .fleet import Replica
from .processes import Children, free_port
from .prompts import MODEL, SIM_TOKENIZER
from .workloads import Workload

REDIS_URL = os.environ.get("KVGATE_BENCH_REDIS", "redis://127.0.0.1:6379/0")
TENANTS: list[dict[str, Any]] = [
    {"name": "vip", "priority": "critical"},
    {"name": "chat-app", "priority": "standard"},
    {"name": "batch", "priority": "sheddable"},  # no tenant limits: the others have none
    {"name": "anonymous", "priority": "standard"},
]
# Simulated seconds: each class's latency target (kvgate refuses at arrival what it expects
# to start later), set as an operator would for the goodput thresholds measured.
TTFT_TARGET_S = {"critical": 30.0, "standard": 2.0, "sheddable": 1.0}
AFFINITY_WAIT_S = 0.25  # a session waits this long for its replica (kvgate's default)
MAX_WAIT_S = 30.0
DISCOVERY_INTERVAL_S = 2.0
VLLM_ROUTER_POLICIES = ("round_robin", "power_of_two", "cache_aware")


@dataclass(frozen=True, slots=True)
class Contender:
    name: str
    kind: str  # "direct", "vllm-router" or "kvgate"
    policy: str | None = None  # vllm-router's --policy
    mode: str | None = None  # kvgate's admission.mode
    rule: str | None = None  # kvgate's admission.prediction.rule (None: its default)
    instances: int = 1  # kvgate processes
    redis: bool = False
    describe: str = ""
    tree: str | None = None  # kvgate run from this checkout's code (`--ab`), not this one's
    targets: bool = True  # kvgate: the per-class latency targets and queue of TTFT_TARGET_S
    kv_events: bool = False  # kvgate subscribes to the replicas' KV cache events
    vllm_priority: bool = False  # the replicas schedule by priority, and the pools say so



CONTENDERS: dict[str, Contender] = {c.name: c for c in [
    Contender("direct-rr", "direct",
              describe="round robin straight to the replicas, long documents to the long one"),
    *(Contender(f"vllm-router-{p}", "vllm-router", policy=p,
                describe=f"vllm-router --policy {p}, one router per pool")
      for p in VLLM_ROUTER_POLICIES),
    Contender("kvgate-worst", "kvgate", mode="worst_case",
              describe="kvgate, admission.mode worst_case"),
    Contender("kvgate-predicted", "kvgate", mode="predicted",
              describe="kvgate, admission.mode predicted (every class)"),
    Contender("kvgate-predicted-lookahead", "kvgate", mode="predicted", rule="lookahead",
              describe="kvgate, admission.mode predicted, prediction.rule lookahead"),
    Contender("kvgate-events", "kvgate", mode="predicted", kv_events=True,
              describe="kvgate, admission.mode predicted, routing on the replicas' KV events"),
    Contender("kvgate-defaults", "kvgate", mode="predicted", targets=False,
              describe="kvgate, admission as shipped: no latency targets, max_wait_s 60 s"),
    Contender("kvgate-redis-x2", "kvgate", mode="predicted", instances=2, redis=True,
              describe="two kvgate instances sharing Redis state, predicted, load split"),
    Contender("kvgate-priority", "kvgate", mode="predicted", vllm_priority=True,
              describe="kvgate, predicted, the class sent as vLLM's priority (replicas "
                       "--scheduling-policy priority)"),
]}  # fmt: skip


def from_tree(contender: Contender, tree: str) -> Contender:
    """The same kvgate contender, run from another checkout (`NAME@base`): before against
    after in one run, on the same workload, fleet and machine."""
    return dataclasses.replace(contender, name=f"{contender.name}@base", tree=tree,
                               describe=f"{contender.describe}, the code at {tree}")


def named(name: str, ab: str | None = None) -> Contender:
    """A contender by name; `NAME@base` is NAME from the `--ab` checkout."""
    if name.endswith("@base"):
        assert ab is not None, f"{name}: needs --ab"
        return from_tree(CONTENDERS[name.removesuffix("@base")], ab)
    return CONTENDERS[name]


@dataclass(slots=True)
class Running:
    """A started contender: where to send each kind of request, and what to undo after."""

    targets: dict[str, list[str]]
    tenant_header: str | None
    redis_prefix: str | None = None


async def start(contender: Contender, children: Children, http: aiohttp.ClientSession,
                fleet: list[Replica], workload: Workload, time_scale: float, run_id: str,
                models: list[dict[str, Any]] | None = None) -> Running:  # fmt: skip
    """Start the contender's processes against a running fleet; return once it serves.
    `models`: kvgate's `models` section (real engines: their own tokenizer), else the
    simulator's where routing needs it."""
    normal = [r.url for r in fleet if r.pool == "default"]
    long = [r.url for r in fleet if r.pool == "long"]
    if contender.kind == "direct":
        return Running({"short": normal, "long": long}, None)
    if contender.kind == "vllm-router":
        return await _start_vllm_router(contender, children, http, normal, long)
    return await _start_kvgate(contender, children, http, fleet, workload, time_scale, run_id,
                               models)


def available(contender: Contender, workload: Workload | None = None) -> str | None:
    """Why the contender cannot run here (on `workload`), or None."""
    if contender.kind == "vllm-router" and vllm_router_command() is None:
        return "the vllm-router command is not installed (pip install -e '.[bench]')"
    if contender.kv_events and workload is not None and not workload.kv_events:
        return f"the {workload.name} workload's replicas publish no KV events (rag's do)"
    return None


def vllm_router_command() -> str | None:
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


async def _start_vllm_router(contender: Contender, children: Children,
                             http: aiohttp.ClientSession, normal: list[str], long: list[str],
                             ) -> Running:  # fmt: skip
    command = vllm_router_command()
    assert command is not None and contender.policy is not None
    urls: dict[str, str] = {}
    for pool, workers, policy in (("default", normal, contender.policy),
                                  ("long", long, "round_robin")):  # fmt: skip
        if not workers:  # a fleet of one pool (bench/real_fleet.py's)
            continue
        port = free_port()
        children.start(f"vllm-router-{pool}", [
            command, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", policy, "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--log-level", "warning",
        ])  # fmt: skip
        urls[pool] = f"http://127.0.0.1:{port}"
    for pool, url in urls.items():
        await children.wait_ready(http, f"vllm-router-{pool}", url + "/health")
    return Running({"short": [urls["default"]], "long": [urls.get("long", urls["default"])]},
                   None)


def kvgate_config(contender: Contender, fleet: list[Replica], workload: Workload,
                  time_scale: float, port: int, redis_prefix: str | None,
                  models: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The gateway's config tree (what `kvgate serve --config` reads)."""
    scaled = {name: round(s * time_scale, 4) for name, s in TTFT_TARGET_S.items()}
    admission: dict[str, Any] = {
        "mode": contender.mode,
        "queue": {"max_depth": 1024, "max_wait_s": MAX_WAIT_S * time_scale,
                  "ttft_target_s": scaled},
    }  # fmt: skip
    if not contender.targets:  # kvgate's own queue defaults, in simulated seconds
        defaults = QueueConfig()
        admission["queue"] = {"max_wait_s": defaults.max_wait_s * time_scale}
    if contender.rule is not None:
        admission["prediction"] = {"rule": contender.rule}
    pools: dict[str, Any] = {}
    for replica in fleet:
        pool = pools.setdefault(replica.pool, {"replicas": []})
        if contender.vllm_priority:
            pool["scheduling_policy"] = "priority"
        entry: dict[str, Any] = {"url": replica.url, "name": replica.name}
        if contender.kv_events and replica.kv_events is not None:
            entry["kv_events"] = replica.kv_events
            pool["kv_events"] = {}
        pool["replicas"].append(entry)
    if "long" in pools:
        pools["long"]["min_worst_case_tokens"] = workload.long_pool_min_tokens
    if models is None and contender.kv_events:
        # the chats' token ids, exactly, where routing reads the replicas' caches
        models = [{"name": MODEL, "tokenizer": SIM_TOKENIZER}]
    state: dict[str, Any] = {"backend": "memory"}
    if redis_prefix is not None:
        state = {"backend": "redis", "redis_url": REDIS_URL, "key_prefix": redis_prefix}
    return {
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "pools": pools,
        "discovery": {"interval_s": DISCOVERY_INTERVAL_S * time_scale,
                      "stale_after_s": 5 * DISCOVERY_INTERVAL_S * time_scale},
        "admission": admission,
        # simulated seconds, like the latency targets: kvgate's default, scaled
        "routing": {"sessions": {"affinity_wait_s": round(AFFINITY_WAIT_S * time_scale, 4)}},
        "auth": {"mode": "trusted_header", "anonymous_tenant": "anonymous",
                 "trusted_networks": ["127.0.0.1/32"]},
        "tenants": [{**t, "api_key_sha256": [hashlib.sha256(t["name"].encode()).hexdigest()]}
                    for t in TENANTS],
        "state": state,
        **({} if models is None else {"models": models}),
    }  # fmt: skip


async def _start_kvgate(contender: Contender, children: Children, http: aiohttp.ClientSession,
                        fleet: list[Replica], workload: Workload, time_scale: float,
                        run_id: str, models: list[dict[str, Any]] | None) -> Running:  # fmt: skip
    prefix = f"kvgate-bench-{run_id}" if contender.redis else None
    urls = []
    for n in range(contender.instances):
        port = free_port()
        config = kvgate_config(contender, fleet, workload, time_scale, port, prefix, models)
        path = children.logs / f"kvgate-{n}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        tree = None if contender.tree is None else Path(contender.tree)
        children.start(f"kvgate-{n}", [sys.executable, "-m", "kvgate.cli", "serve",
                                       "--config", str(path), "--log-level", "WARNING",
                                       "--workers", "1"],  # one process per instance
                       env=None if tree is None else {"PYTHONPATH": str(tree)}, cwd=tree)
        urls.append(f"http://127.0.0.1:{port}")
    for n, url in enumerate(urls):
        await children.wait_ready(http, f"kvgate-{n}", url + "/ready")
        await _until_discovered(http, url, len(fleet))
    return Running({"short": urls, "long": urls}, "X-Tenant-Id", redis_prefix=prefix)


async def _until_discovered(http: aiohttp.ClientSession, url: str, replicas: int,
                            timeout_s: float = 10.0) -> None:  # fmt: skip
    """Until /admin/replicas shows every replica healthy with its KV capacity known (or the
    endpoint does not say; admission would refuse before discovery)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with http.get(url + "/admin/replicas") as response:
                listed = (await response.json()).get("replicas", [])
                if len(listed) >= replicas and all(
                    r.get("healthy", True) and r.get("num_gpu_blocks", 1) for r in listed
                ):
                    return
        await asyncio.sleep(0.05)


def clean_redis(prefix: str) -> int:
    """Delete every key of a run's Redis prefix; how many there were."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        return len(keys)
    finally:
        client.close()
