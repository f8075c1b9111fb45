"""Soak: many concurrent streaming clients through kvgate to a simulated fleet, for minutes,
with random disconnects. Run by hand, not in CI.

Starts (each its own process, on 127.0.0.1): `--replicas` simulated vLLM replicas, one
`kvgate serve` in front of them, and a probe that GETs kvgate's /health every 100 ms (its
latency is kvgate's event-loop lag plus a localhost round trip; in its own process so that the
clients' loop does not inflate it). This process runs `--clients` closed-loop streaming
clients; each request has a `--disconnect` chance of hanging up after its first chunk.

Every `--sample-s` it records kvgate's resident memory, open file descriptors, the probe's
worst latency in the window, requests done and errors. At the end, once the clients have
stopped, it checks that nothing leaked: every replica's reserved blocks and in-flight count,
and kvgate's queue depth, back to zero. Writes a markdown report.

    .venv/bin/python bench/soak.py [--clients 2000] [--duration 300] [--replicas 4]
        [--sample-s 10] [--disconnect 0.2] [--out bench/results/soak.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleetbench.processes import Children, free_port

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import http.client, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
while True:
    started = time.perf_counter()
    try:
        conn.request("GET", "/health"); conn.getresponse().read()
    except Exception:
        conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
        continue
    print(f"{time.perf_counter() - started:.6f}", flush=True)
    time.sleep(0.1)
"""


@dataclass
class Tally:
    done: int = 0
    hung_up: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def sockets_by_peer(pid: int, port: int) -> dict[str, int]:
    """kvgate's established TCP connections: from clients (to `port`) and to replicas."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True,
                         text=True, check=False).stdout
    counts = {"clients": 0, "replicas": 0}
    for line in out.splitlines():
        if f"pid={pid}," in line:
            local = line.split()[2]
            counts["clients" if local.endswith(f":{port}") else "replicas"] += 1
    return counts


async def client(
    http: aiohttp.ClientSession, url: str, rng: random.Random, disconnect: float,
    stop: asyncio.Event, tally: Tally,
) -> None:
    while not stop.is_set():
        body = {"model": "sim-model", "stream": True, "max_tokens": rng.randint(8, 64),
                "messages": [{"role": "user", "content": f"soak {rng.random()}"}]}
        hang_up = rng.random() < disconnect
        try:
            async with http.post(f"{url}/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    tally.error(f"status {r.status}")
                    await r.read()
                    await asyncio.sleep(0.5)
                    continue
                tail = b""
                async for chunk in r.content.iter_any():
                    if hang_up:
                        tally.hung_up += 1
                        break
                    tail = (tail + chunk)[-64:]
                else:
                    if tail.endswith(b"data: [DONE]\n\n") and b'"error"' not in tail:
                        tally.done += 1
                    else:
                        tally.error("stream cut")
        except (aiohttp.ClientError, TimeoutError) as exc:
            tally.error(f"{type(exc).__name__}: {str(exc)[:80]}")
            await asyncio.sleep(0.5)


async def probe_lags(stdout: asyncio.StreamReader, lags: list[float]) -> None:
    while line := await stdout.readline():
        lags.append(float(line))


async def held(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/admin/replicas") as r:
        replicas = (await r.json())["replicas"]
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    queued = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("kvgate_queue_depth{"))
    return {"reserved_blocks": sum(r["reserved_blocks"] for r in replicas),
            "inflight": sum(r["inflight"] for r in replicas), "queued": queued}


async def main(args: argparse.Namespace) -> int:
    logs = Path(args.logs)
    await asyncio.to_thread(logs.mkdir, parents=True, exist_ok=True)
    ports = [free_port() for _ in range(args.replicas)]
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port, "max_connections": args.clients * 2,
                   "drain_s": 5},
        "discovery": {"interval_s": 1.0},
        "pools": {"default": {"replicas": [{"url": f"http://127.0.0.1:{p}", "name": f"sim-{i}"}
                                           for i, p in enumerate(ports)]}},
    }
    (logs / "kvgate.yaml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    tally, lags, rows = Tally(), [], []
    async with Children(logs) as children, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    ) as http:
        for i, p in enumerate(ports):
            children.start(f"sim-{i}", [
                sys.executable, "-m", "kvgate.cli", "sim", "--port", str(p), "--seed", str(i),
                "--num-gpu-blocks", "40000", "--max-num-seqs", "1024",
                "--time-scale", str(args.time_scale)])  # fmt: skip
        for i, p in enumerate(ports):
            await children.wait_ready(http, f"sim-{i}", f"http://127.0.0.1:{p}/health")
        children.start("kvgate", [sys.executable, "-m", "kvgate.cli", "serve", "--config",
                                  str(logs / "kvgate.yaml"), "--log-level", "WARNING"])
        await children.wait_ready(http, "kvgate", f"{url}/ready")
        pid = children.pids()["kvgate"]
        probe = await asyncio.create_subprocess_exec(
            sys.executable, "-c", PROBE, str(port), stdout=asyncio.subprocess.PIPE)
        assert probe.stdout is not None
        probing = asyncio.create_task(probe_lags(probe.stdout, lags))
        stop = asyncio.Event()
        rng = random.Random(args.seed)
        tasks = [asyncio.create_task(client(http, url, random.Random(rng.random()),
                                            args.disconnect, stop, tally))
                 for _ in range(args.clients)]
        started = time.monotonic()
        try:
            while (elapsed := time.monotonic() - started) < args.duration:
                await asyncio.sleep(args.sample_s)
                window, lags[:] = list(lags), []
                rows.append((elapsed + args.sample_s, rss_mib(pid), open_fds(pid),
                             max(window, default=float("nan")), tally.done, tally.hung_up,
                             sum(tally.errors.values())))
                t, rss, fds, lag, done, hung_up, errors = rows[-1]
                print(f"t={t:5.0f}s rss={rss:6.1f} MiB fds={fds:5.0f} lag_max={lag:.3f}s "
                      f"done={done} hung_up={hung_up} errors={errors}", flush=True)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(3)  # leases and gauges settle
        leftover = await held(http, url)
        await http.close()  # the clients' keep-alive connections too
        await asyncio.sleep(2)
        after = (rss_mib(pid), open_fds(pid), sockets_by_peer(pid, port))
        probe.terminate()
        await probe.wait()
        probing.cancel()
    report(args, rows, tally, leftover, after)
    return 0 if not any(leftover.values()) else 1


def report(args: argparse.Namespace, rows: list[tuple[float, ...]], tally: Tally,
           leftover: dict[str, float], after: tuple[float, int, dict[str, int]]) -> None:  # fmt: skip
    lines = [
        f"# Soak: {args.clients} streaming clients, {args.duration:g} s, {args.replicas} "
        f"simulated replicas, {args.disconnect:.0%} hang up after the first chunk",
        "",
        "| t (s) | kvgate RSS (MiB) | open fds | worst /health latency (s) | done | hung up | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {t:.0f} | {rss:.1f} | {fds:.0f} | {lag:.3f} | {d:.0f} | {h:.0f} | {e:.0f} |"
          for t, rss, fds, lag, d, h, e in rows),
        "",
        f"After the clients stopped: RSS {after[0]:.1f} MiB, {after[1]} fds (TCP connections: "
        f"{after[2]['clients']} from clients (the probe), {after[2]['replicas']} kept alive to "
        "replicas, "
        f"closed after upstream.keepalive_s idle); reserved blocks "
        f"{leftover['reserved_blocks']:.0f}, in flight {leftover['inflight']:.0f}, queued "
        f"{leftover['queued']:.0f}. Errors by kind: {tally.errors or 'none'}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--disconnect", type=float, default=0.2)
    parser.add_argument("--time-scale", type=float, default=0.05,
                        help="the simulated replicas' time scale (smaller: faster tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", default="/tmp/kvgate-soak")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.md"))
    sys.exit(asyncio.run(main(parser.parse_args())))
