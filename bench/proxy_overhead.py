"""What kvgate costs on the request path, measured against two baselines in the same run.

Starts, each in its own process on 127.0.0.1:
  - the upstream: `bench/stub_upstream.py`, a vLLM stand-in that answers at once from
    pre-rendered bytes (not `kvgate sim`, whose engine loop and scheduler would add their
    own cost and jitter to every path and blur the proxy's share);
  - (b) `bench/passthrough.py`, a minimal aiohttp proxy to the stub: what any Python proxy on
    the same stack costs;
  - (c) `kvgate serve --upstream STUB --port N`: in-memory state, admission on, as shipped
    (INFO logging, so aiohttp's access log is on).
Then drives (a) the stub directly, (b) and (c) with the same aiohttp client from this process:
non-streamed chat (max_tokens 16) and streamed chat (32 token chunks), closed loop with C
concurrent clients, a warm-up then a fixed measured time per cell, split into rounds that
interleave the three paths. Reports requests/s, latency p50/p99 and server CPU per request
for each path, and kvgate against both baselines.
Everything shares the machine's cores, so the ratios are the result, not the absolute rates.
Children are stopped on exit (finally, atexit, and the kernel's parent-death signal).

    .venv/bin/python bench/proxy_overhead.py [--duration 5] [--warmup 1]
        [--concurrency 1 32] [--rounds 3] [--out bench/results/proxy_overhead.md]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ctypes
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("direct", "passthrough", "kvgate")
SYSTEM = "You are a helpful assistant for a KV-cache gateway benchmark. Answer briefly. " * 4
JSON = {"Content-Type": "application/json"}
START_TIMEOUT_S = 40.0
REQUEST_TIMEOUT_S = 10.0
RAMP_S = 0.1  # unmeasured lead of every slice after a path's first


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    max_tokens: int
    stream: bool

    def bodies(self, n: int = 64) -> list[bytes]:
        """Request bodies, rendered before the clock starts; distinct user turns."""
        return [orjson.dumps(self.body(i)) for i in range(n)]

    def body(self, i: int) -> dict[str, object]:
        return {
            "model": "sim-model",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question number {i}: what is a KV block?"},
            ],
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }

    def complete(self, raw: bytes) -> bool:
        if self.stream:
            chunks = raw.count(b'"delta":{"content":"')
            return chunks == self.max_tokens and raw.endswith(b"data: [DONE]\n\n")
        return raw.count(b"word ") == self.max_tokens


WORKLOADS = (
    Workload("non-streamed (max_tokens 16)", 16, False),
    Workload("streamed (32 chunks)", 32, True),
)


@dataclass(frozen=True, slots=True)
class Cell:
    """One path under one workload and concurrency: what the measured window saw."""

    workload: str
    concurrency: int
    path: str
    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p99_ms: float
    proxy_cpu_ms: float | None  # CPU time of the proxy process per request (none when direct)
    stub_cpu_ms: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values)) - 1))
    return sorted_values[index]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Children:
    """The server processes; `stop` ends every one (idempotent; registered with atexit)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        atexit.register(self.stop)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the driver dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


async def start_servers(children: Children) -> dict[str, str]:
    """Start stub, passthrough and kvgate; return each path's base URL once all are ready."""
    py = sys.executable
    ports = {name: free_port() for name in PATHS}
    stub = f"http://127.0.0.1:{ports['direct']}"
    children.start("stub", [py, "bench/stub_upstream.py", "--port", str(ports["direct"])])
    children.start("passthrough", [py, "bench/passthrough.py", "--upstream", stub,
                                   "--port", str(ports["passthrough"])])  # fmt: skip
    children.start("kvgate", [py, "-m", "kvgate.cli", "serve", "--upstream", stub,
                              "--port", str(ports["kvgate"])])  # fmt: skip
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    async with aiohttp.ClientSession() as http:
        await wait_ready(http, children, "stub", stub + "/health")
        await wait_ready(http, children, "passthrough", urls["passthrough"] + "/health")
        await wait_ready(http, children, "kvgate", urls["kvgate"] + "/ready")
    return urls


@dataclass(slots=True)
class Tally:
    """What one path's measured windows saw, summed over the rounds."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per process


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
            ok = False
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.post(url, data=bodies[i % len(bodies)], headers=JSON,
                                     timeout=timeout) as response:  # fmt: skip
                    raw = await response.read()
                    ok = response.status == 200 and workload.complete(raw)
            ended = clock()
            i += concurrency
            if start_at <= ended < stop_at:
                if ok:
                    tally.latencies.append(ended - began)
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
    """The three paths under one workload and concurrency, interleaved: `rounds` rounds, each
    giving every path an equal slice (in rotating order), so drifting background load on a
    shared machine falls on all paths alike. Each path's first slice starts with the warm-up;
    later ones with a short unmeasured lead while the clients ramp up."""
    bodies = workload.bodies()
    window = args.duration / args.rounds
    tallies = {path: Tally() for path in PATHS}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {
            path: await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
            )
            for path in PATHS
        }
        for r in range(args.rounds):
            for path in PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]:
                await run_slice(
                    sessions[path], urls[path] + "/v1/chat/completions", workload, bodies,
                    concurrency, args.warmup if r == 0 else RAMP_S, window, cpu, tallies[path],
                )  # fmt: skip
    return [cell(workload, concurrency, path, tallies[path]) for path in PATHS]


def cell(workload: Workload, concurrency: int, path: str, tally: Tally) -> Cell:
    latencies = sorted(tally.latencies)
    n = len(latencies)

    def per_request(name: str) -> float:
        return tally.cpu[name] * 1000 / n if n else float("nan")

    return Cell(
        workload.name, concurrency, path, n, tally.seconds, tally.errors,
        percentile(latencies, 0.50) * 1000, percentile(latencies, 0.99) * 1000,
        None if path == "direct" else per_request(path), per_request("stub"),
    )  # fmt: skip


def render(cells: list[Cell], args: argparse.Namespace) -> str:
    rows = [
        f"| {c.workload} | {c.concurrency} | {c.path} | {c.rate:.0f} | {c.p50_ms:.2f} "
        f"| {c.p99_ms:.2f} | {'—' if c.proxy_cpu_ms is None else f'{c.proxy_cpu_ms:.2f}'} "
        f"| {c.stub_cpu_ms:.2f} | {c.errors} |"
        for c in cells
    ]
    by_key = {(c.workload, c.concurrency, c.path): c for c in cells}
    ratios = []
    for w in WORKLOADS:
        for conc in args.concurrency:
            d, p, k = (by_key[(w.name, conc, path)] for path in PATHS)
            pt_cpu = p.proxy_cpu_ms or float("nan")
            ratios.append(
                f"| {w.name} | {conc} | {k.rate / d.rate:.2f} | {k.rate / p.rate:.2f} "
                f"| {k.p50_ms - d.p50_ms:+.2f} | {k.p50_ms - p.p50_ms:+.2f} "
                f"| {k.p99_ms - p.p99_ms:+.2f} | {(k.proxy_cpu_ms or 0) / pt_cpu:.1f}× |"
            )
    command = "python bench/proxy_overhead.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return "\n".join([
        "# kvgate proxy overhead: direct vs minimal pass-through vs kvgate",
        "",
        "| workload | C | path | req/s | p50 ms | p99 ms | proxy CPU ms/req | stub CPU ms/req "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "kvgate against the baselines (req/s ratios; added latency in ms; CPU per request of "
        "kvgate's process over the pass-through's):",
        "",
        "| workload | C | req/s kvgate/direct | req/s kvgate/passthrough | p50 added vs direct "
        "| p50 added vs passthrough | p99 added vs passthrough | CPU/req kvgate/passthrough |",
        "|---|---|---|---|---|---|---|---|",
        *ratios,
        "",
        f"- Command: `{command.strip()}`",
        f"- Load: closed loop, C concurrent aiohttp clients in the driver process; "
        f"{args.warmup:g} s warm-up then {args.duration:g} s measured per path and cell, in "
        f"{args.rounds} interleaved rounds (paths in rotating order; {RAMP_S:g} s unmeasured "
        "ramp per later slice); latency is "
        "request sent → last byte read (whole SSE stream when streamed).",
        "- Upstream: bench/stub_upstream.py (pre-rendered answers, one write per SSE event); "
        "passthrough: bench/passthrough.py; kvgate: `kvgate serve --upstream STUB --port N` "
        "(memory state, admission on, INFO logging with the access log). Each in its own "
        "process, all on 127.0.0.1, uvloop everywhere.",
        f"- Machine: `nproc` = {os.cpu_count()} cores shared by the client, the proxy and the "
        "stub (and other work on this host), so absolute rates are low and noisy; compare the "
        f"ratios. Load average before the run: {args.load_before}. "
        f"{platform.system()} {platform.release()}, {platform.machine()}.",
        f"- Python {platform.python_version()}, aiohttp {aiohttp.__version__}.",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ])  # fmt: skip


async def measure(args: argparse.Namespace, children: Children) -> list[Cell]:
    this = asyncio.current_task()
    assert this is not None
    # SIGTERM cancels the run, so `finally` in main stops the children.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
    urls = await start_servers(children)
    pids = {name: proc.pid for name, proc in children.procs.items()}

    def cpu() -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in pids.items()}

    cells = []
    for workload in WORKLOADS:
        for concurrency in args.concurrency:
            for c in await run_cells(urls, workload, concurrency, args, cpu):
                print(f"  {c.workload:30} C={c.concurrency:<3} {c.path:12} "
                      f"{c.rate:7.0f} req/s  p50 {c.p50_ms:6.2f} ms", flush=True)  # fmt: skip
                cells.append(c)
    return cells


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved slices per path")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "proxy_overhead.md"))
    args = parser.parse_args()
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
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
        finally:
            children.stop()
    text = render(cells, args)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 1 if any(c.errors for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
