"""`kvgate demo`: a simulated fleet on loopback with kvgate in front, in one process.

Two normal replicas and one long-context replica (the vLLM simulator), and kvgate with
in-memory state. Without `--workload` it serves until Ctrl-C and tells you where to point an
OpenAI client. With `--workload` it drives the same seeded mixed workload twice — first
straight at the replicas with the same routing but no admission control (long documents to
the long replica, chats round robin over the others), then through kvgate, each on a fresh
fleet — and prints what happened side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import signal
import sys
from typing import Any

import orjson
from aiohttp import web

from kvgate.app import build_app
from kvgate.config import Config, parse_config
from kvgate.sim.config import SimConfig
from kvgate.sim.server import SimReplica
from kvgate.tokens import load_tiktoken
from kvgate.workload import build_workload, run_workload, summarize

# Sized so the workload overloads the normal replicas: 6,400 tokens of KV each.
FLEET: dict[str, dict[str, Any]] = {
    "normal-a": dict(num_gpu_blocks=400, max_model_len=4096, seed=1),
    "normal-b": dict(num_gpu_blocks=400, max_model_len=4096, seed=2),
    "long": dict(num_gpu_blocks=2400, max_model_len=16384, max_num_batched_tokens=8192, seed=3),
}
# Answers use 60-100% of max_tokens: near the worst case, where overload makes vLLM preempt.
OUTPUT_LEN_DIST, OUTPUT_LEN_MIN_FRACTION = "uniform", 0.6
# A tenant's API key is its name ("demo" for the anonymous tenant); the workload driver names
# its tenant in the X-Tenant-Id header instead, which kvgate trusts from 127.0.0.1.
TENANTS: list[dict[str, Any]] = [
    {"name": "vip", "priority": "critical"},
    {"name": "chat-app", "priority": "standard", "tokens_per_minute": 3_000_000},
    {"name": "batch", "priority": "sheddable", "max_concurrent": 16},
    {"name": "anonymous", "priority": "standard"},
]
DEMO_KEYS = {"anonymous": "demo"}


def _with_keys(tenant: dict[str, Any]) -> dict[str, Any]:
    key = DEMO_KEYS.get(tenant["name"], tenant["name"])
    return {**tenant, "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8080, help="kvgate's port (0: any free)")
    parser.add_argument("--workload", action="store_true",
                        help="drive a mixed workload, without and with kvgate, and summarise")
    parser.add_argument("--duration", type=float, default=10.0, help="workload seconds")
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="simulated GPU speed: real seconds per simulated second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 0


async def _main(args: argparse.Namespace) -> int:
    tokenizer = await asyncio.to_thread(load_tiktoken)
    if not args.workload:
        fleet = await start_fleet(tokenizer, args.time_scale)
        runner, url = await start_gateway(gateway_config(fleet, args.port))
        print(banner(url, fleet))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            await stop_fleet(fleet)
        return 0

    items = build_workload(seed=args.seed, duration_s=args.duration, rate=args.rate)
    report: dict[str, Any] = {"workload": {
        "requests": len(items), "duration_s": args.duration, "rate_per_s": args.rate,
        "long": sum(1 for i in items if i.kind == "long")}}

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr)

    say(f"straight to the replicas: {len(items)} requests over {args.duration:g}s ...")
    fleet = await start_fleet(tokenizer, args.time_scale)
    # The same routing kvgate does (long documents to the long replica, chats round robin over
    # the normal ones), without admission: the difference is what admission control does.
    targets = {"short": [fleet["normal-a"].url, fleet["normal-b"].url], "long": [fleet["long"].url]}
    results = await run_workload("", items, targets=targets, tenant_header=None)
    report["no_admission"] = {**summarize(results).as_dict(), "replicas": replica_stats(fleet)}
    await stop_fleet(fleet)

    say("the same workload through kvgate ...")
    fleet = await start_fleet(tokenizer, args.time_scale)
    runner, url = await start_gateway(gateway_config(fleet, 0))
    results = await run_workload(url, items)
    report["kvgate"] = {**summarize(results).as_dict(), "replicas": replica_stats(fleet)}
    await runner.cleanup()
    await stop_fleet(fleet)

    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render(report))
    return 0


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


def gateway_config(fleet: dict[str, SimReplica], port: int) -> Config:
    return parse_config({
        "server": {"port": port},
        "pools": {
            "default": {"replicas": [{"url": fleet["normal-a"].url, "name": "normal-a"},
                                     {"url": fleet["normal-b"].url, "name": "normal-b"}]},
            "long": {"replicas": [{"url": fleet["long"].url, "name": "long"}],
                     "min_worst_case_tokens": 3072},
        },
        "discovery": {"interval_s": 0.5},
        "admission": {"queue": {"max_wait_s": 20, "max_depth": 1024}},
        "auth": {"mode": "trusted_header", "anonymous_tenant": "anonymous",
                 "trusted_networks": ["127.0.0.1/32", "::1/128"]},
        "tenants": [_with_keys(t) for t in TENANTS],
    })


async def start_gateway(config: Config) -> tuple[web.AppRunner, str]:
    app = build_app(config)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://{config.server.host}:{port}"
    await _until_discovered(app)
    return runner, url


async def _until_discovered(app: web.Application) -> None:
    from kvgate.api.routes import GATEWAY

    registry = app[GATEWAY].registry
    for _ in range(200):
        if all(r.healthy and r.num_gpu_blocks for r in registry):
            return
        await asyncio.sleep(0.05)


def replica_stats(fleet: dict[str, SimReplica]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, replica in fleet.items():
        stats = replica.engine.stats
        queries = stats.prefix_cache_queries
        out[name] = {
            "finished": stats.finished,
            "preemptions": stats.num_preemptions,
            "prefix_hit_rate": round(stats.prefix_cache_hits / queries, 3) if queries else None,
        }
    return out


def banner(url: str, fleet: dict[str, SimReplica]) -> str:
    lines = [
        f"kvgate is listening on {url}, in front of a simulated fleet:",
        *(f"  {name:9} {r.url}  {r.config.num_gpu_blocks} blocks, "
          f"max_model_len {r.config.max_model_len}" for name, r in fleet.items()),
        "",
        "Point an OpenAI client at it:",
        f'  client = openai.OpenAI(base_url="{url}/v1", api_key="demo")',
        '  client.chat.completions.create(model="sim-model", messages=[{"role": "user", '
        '"content": "hi"}])',
        "",
        "Look at:",
        f"  {url}/metrics          kvgate's metrics (kvgate_replica_blocks_reserved, ...)",
        f"  {url}/admin/replicas   each replica: blocks total / reserved / written, vLLM's view",
        f"  {fleet['normal-a'].url}/metrics   a replica's own vLLM metrics",
        "Tenants: api_key \"vip\" (critical), \"chat-app\", \"batch\" (sheddable), \"demo\" "
        "(anonymous); or X-Tenant-Id from 127.0.0.1. Ctrl-C to stop.",
    ]
    return "\n".join(lines)


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    rows = [f"workload: {w['requests']} requests ({w['long']} long documents) over "
            f"{w['duration_s']:g}s, {w['rate_per_s']:g}/s", ""]
    header = f"{'':28}{'no admission':>16}{'through kvgate':>16}"
    rows.append(header)
    rr, kv = report["no_admission"], report["kvgate"]

    def row(label: str, a: Any, b: Any) -> None:
        rows.append(f"{label:28}{_fmt(a):>16}{_fmt(b):>16}")

    row("completed", rr["completed"], kv["completed"])
    row("failed (5xx, dropped)", rr["failed"], kv["failed"])
    for reason in sorted(set(rr["refused"]) | set(kv["refused"])):
        row(f"refused {reason}", rr["refused"].get(reason, 0), kv["refused"].get(reason, 0))
    for kind in ("short", "long"):
        for q in ("p50", "p99"):
            row(f"TTFT {kind} {q} (s)", rr["ttft_s"][kind][q], kv["ttft_s"][kind][q])
        for q in ("p50", "p99"):
            row(f"end to end {kind} {q} (s)", rr["e2e_s"][kind][q], kv["e2e_s"][kind][q])
    for tenant in ("vip", "chat-app", "batch"):  # vip is critical, batch sheddable
        key = f"tenant {tenant}"
        if key in kv["ttft_s"]:
            row(f"TTFT {tenant} p50 (s)", rr["ttft_s"][key]["p50"], kv["ttft_s"][key]["p50"])
    for name in rr["replicas"]:
        row(f"{name} preemptions", rr["replicas"][name]["preemptions"],
            kv["replicas"][name]["preemptions"])
        row(f"{name} prefix hit rate", rr["replicas"][name]["prefix_hit_rate"],
            kv["replicas"][name]["prefix_hit_rate"])
    return "\n".join(rows)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
