"""How many requests per second one `kvgate sim` process serves: its own overhead, not the GPU's.

Starts one replica as a subprocess (`kvgate sim`, a tiny time_scale so simulated GPU time is
not the limit), drives it from this process with aiohttp, and reports requests/s for
short non-streamed chat requests (max_tokens 16) and streamed chat requests of 32 tokens.
Each phase runs for a fixed time after a warm-up; the whole run stops by itself.

    .venv/bin/python bench/sim_throughput.py [--duration 8] [--concurrency 64]
        [--out bench/results/sim_throughput.md]

Targets (2-core machine, one replica process): >= 300 non-streamed req/s, >= 100 streamed
32-token req/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant for a KV-cache gateway benchmark. Answer briefly. " * 4
TARGETS = {"non-streamed (max_tokens 16)": 300.0, "streamed (32 tokens)": 100.0}


@dataclass
class Phase:
    name: str
    requests: int
    seconds: float
    errors: int
    tokens: int

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def body(i: int, max_tokens: int, stream: bool) -> bytes:
    return orjson.dumps(
        {
            "model": "sim-model",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question number {i}: what is a KV block?"},
            ],
            "max_tokens": max_tokens,
            "stream": stream,
            "ignore_eos": True,
        }
    )


async def one_request(
    http: aiohttp.ClientSession, url: str, i: int, max_tokens: int, stream: bool
) -> int:
    """Send one request; return the completion tokens received (raises on a bad answer)."""
    headers = {"Content-Type": "application/json"}
    async with http.post(url, data=body(i, max_tokens, stream), headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        if not stream:
            reply = orjson.loads(await response.read())
            return int(reply["usage"]["completion_tokens"])
        tokens = 0
        done = False
        async for line in response.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: ") and b'"content":"' in line and b'"role"' not in line:
                tokens += 1
        if not done:
            raise RuntimeError("stream ended without [DONE]")
        return tokens


async def run_phase(
    url: str, name: str, max_tokens: int, stream: bool, concurrency: int, duration: float,
    warmup: float,
) -> Phase:  # fmt: skip
    connector = aiohttp.TCPConnector(limit=concurrency)
    counter = 0
    done = errors = tokens = 0
    measuring = False
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + warmup + duration

    async def worker() -> None:
        nonlocal counter, done, errors, tokens
        while loop.time() < stop_at:
            counter += 1
            try:
                got = await one_request(http, url, counter, max_tokens, stream)
            except (aiohttp.ClientError, RuntimeError):
                errors += measuring
                continue
            if measuring:
                done += 1
                tokens += got

    async with aiohttp.ClientSession(connector=connector) as http:
        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        await asyncio.sleep(warmup)
        measuring, started = True, time.perf_counter()
        await asyncio.sleep(duration)
        measuring, seconds = False, time.perf_counter() - started
        await asyncio.gather(*tasks)
    return Phase(name, done, seconds, errors, tokens)


async def start_replica(args: argparse.Namespace) -> tuple[asyncio.subprocess.Process, str]:
    command = [
        sys.executable, "-m", "kvgate.cli", "sim", "--port", "0",
        "--num-gpu-blocks", "16384", "--max-model-len", "4096",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
        "--time-scale", str(args.time_scale),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, cwd=ROOT
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
    if not line.startswith("sim "):
        process.kill()
        raise RuntimeError(f"kvgate sim did not start: {line!r}")
    return process, line.split()[1]


def report(phases: list[Phase], args: argparse.Namespace, server_line: str) -> str:
    rows = [
        f"| {p.name} | {p.rate:.0f} | {TARGETS[p.name]:.0f} | "
        f"{'yes' if p.rate >= TARGETS[p.name] else 'NO'} | {p.requests} in {p.seconds:.1f} s "
        f"| {p.errors} |"
        for p in phases
    ]
    command = "python bench/sim_throughput.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    return "\n".join(
        [
            "# Simulator throughput (one `kvgate sim` process)",
            "",
            "| workload | req/s | target | met | measured | errors |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"- Command: `{command.strip()}`",
            f"- Replica: `{server_line}` (spawned as `kvgate sim --time-scale {args.time_scale}`)",
            f"- Load: {args.concurrency} concurrent clients (aiohttp, in the driver process), "
            f"{args.warmup:g} s warm-up then {args.duration:g} s measured per workload",
            f"- Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with the "
            f"load driver and other work), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}",
            f"- CPU: {_cpu_model()}; load average before the run: {args.load_before}",
            f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
        ]
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


async def main(args: argparse.Namespace) -> int:
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    process, url = await start_replica(args)
    server_line = ""
    try:
        server_line = url
        chat = url + "/v1/chat/completions"
        phases = [
            await run_phase(chat, "non-streamed (max_tokens 16)", 16, False,
                            args.concurrency, args.duration, args.warmup),
            await run_phase(chat, "streamed (32 tokens)", 32, True,
                            args.concurrency, args.duration, args.warmup),
        ]  # fmt: skip
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 30)
    text = report(phases, args, server_line)
    print(text)
    if args.out:
        await asyncio.to_thread(_write, Path(args.out), text)
    return 0 if all(p.rate >= TARGETS[p.name] and not p.errors for p in phases) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=0.001)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "sim_throughput.md"))
    sys.exit(asyncio.run(main(parser.parse_args())))
