"""How long one large request body holds kvgate's event loop: the loop's worst stall while a
body of 1, 8 or 32 MiB goes through the request path.

A ticker task on kvgate's loop sleeps 1 ms again and again and records the largest gap between
two wake-ups; everything else on that loop (every other request, the gauges, discovery) waits
at least that long. Two measurements per body:

  stages  each stage of the request path called on the loop in turn, the ticker running
          (parse & validate, normalize & fingerprint, count tokens, the upstream payload):
          which part would hold the loop, were it run there;
  front   the front of the path as the gateway takes it (`kvgate.request.front`: a large body in a
          worker process), after one body has started the workers;
  http    the whole path over real sockets: kvgate in this process (memory store, admission
          on), `python -m kvgate.sim.stub` as the replica and the client in processes of their
          own (so that neither building nor sending the body runs on kvgate's loop).

Bodies, each of about the size asked: `document` (one user message of prose, some of it
non-ASCII), `conversation` (4,000 messages of prose, under `server.max_messages`) and `tools`
(a short chat with many tool definitions, each with a nested JSON schema). Reported per shape
and size: the worst stall of `--repeat` requests (and the median of their worst stalls), with
the status kvgate answered.

    .venv/bin/python bench/body_stall.py [--sizes 1 8 32] [--repeat 3] [--mode stages http]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvgate.app import build_app  # noqa: E402
from kvgate.config import parse_config  # noqa: E402
from kvgate.request.catalog import upstream_payload  # noqa: E402
from kvgate.request.parsed import Endpoint, parse_body  # noqa: E402

MIB = 1 << 20
MODEL = "sim-model"
PROSE = "The quick brown fox jumps over the lazy dog; naïve café, déjà vu — 東京 ✓. "


def document(size: int) -> bytes:
    text = PROSE * (size // len(PROSE.encode()))
    return orjson.dumps({"model": MODEL, "max_tokens": 8,
                         "messages": [{"role": "user", "content": text}]})


def conversation(size: int) -> bytes:
    n = 4000
    text = PROSE * max(1, size // n // len(PROSE.encode()))
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                for i in range(n - 1)] + [{"role": "user", "content": "and now?"}]
    return orjson.dumps({"model": MODEL, "max_tokens": 8, "messages": messages})


def tools(size: int) -> bytes:
    def tool(i: int) -> dict[str, Any]:
        properties = {f"field_{j}": {"type": "string", "description": f"the {j}th field of {i}",
                                     "enum": ["a", "b", "c"]} for j in range(20)}
        return {"type": "function", "function": {
            "name": f"tool_{i}", "description": "looks things up",
            "parameters": {"type": "object", "properties": properties,
                           "required": ["field_0"]}}}

    one = len(orjson.dumps(tool(0)))
    return orjson.dumps({"model": MODEL, "max_tokens": 8, "tools": [tool(i) for i in range(size // one)],
                         "messages": [{"role": "user", "content": "which tool?"}]})


SHAPES: dict[str, Callable[[int], bytes]] = {
    "document": document, "conversation": conversation, "tools": tools,
}


class Ticker:
    """The loop's largest gap between two 1 ms sleeps, since the last `reset`."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - before - 0.001)

    def reset(self) -> None:
        self.worst = 0.0

    @contextlib.asynccontextmanager
    async def running(self) -> Any:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.sleep(0.01)
        try:
            yield self
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(stub_url: str, max_body: int) -> Any:
    return parse_config({
        "server": {"max_body_bytes": max_body, "client_timeout_s": 120},
        "auth": {"mode": "none"},
        "state": {"backend": "memory"},
        # a stalled loop (or a stub busy parsing) must not read as an unhealthy replica here
        "discovery": {"interval_s": 0.5, "timeout_s": 10},
        "timeouts": {"first_byte_s": 120, "total_s": 300},
        "pools": {"default": {"replicas": [{
            "url": stub_url, "name": "stub", "num_gpu_blocks": 4_000_000, "block_size": 16,
            "max_model_len": 60_000_000}]}},
    })


@contextlib.contextmanager
def stub_upstream() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "kvgate.sim.stub", "--port", str(port)])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


async def worst_of(ticker: Ticker, step: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    await asyncio.sleep(0.02)
    ticker.reset()
    result = await step()
    await asyncio.sleep(0.005)
    return ticker.worst, result


async def stages(sizes: list[int], repeat: int, stub_url: str) -> list[dict[str, Any]]:
    """Each stage of the request path on its own, on this loop, with the ticker."""
    from kvgate.api.routes import GATEWAY

    app = build_app(config(stub_url, 64 * MIB))
    gateway = app[GATEWAY]
    rt = gateway.runtime
    tenant = rt.directory.identify({}, "127.0.0.1")
    rows = []
    async with Ticker().running() as ticker:
        for shape, make in SHAPES.items():
            for mib in sizes:
                raw = make(mib * MIB)
                worst: dict[str, list[float]] = {}
                for _ in range(repeat):
                    async def parse(body: bytes = raw) -> Any:
                        return parse_body(body, Endpoint.CHAT, 4096)

                    stall, parsed = await worst_of(ticker, parse)
                    worst.setdefault("parse", []).append(stall)

                    async def apply(p: Any = parsed) -> Any:
                        return gateway.front.prompts.apply(p, tenant, rt.config)

                    stall, (normalized, _) = await worst_of(ticker, apply)
                    worst.setdefault("normalize", []).append(stall)
                    stall, count = await worst_of(
                        ticker, lambda n=normalized: rt.catalog.count(n))
                    worst.setdefault("count", []).append(stall)
                    terms = gateway.sizing.terms(rt, normalized, count)
                    bound = gateway.bound(normalized, count, terms, tenant,
                                          rt.config.model(normalized.model), None)

                    async def payload(n: Any = normalized, b: Any = bound, kept: Any = (
                            raw if normalized is parsed else None)) -> Any:
                        return upstream_payload(n, b, kept)

                    stall, _ = await worst_of(ticker, payload)
                    worst.setdefault("payload", []).append(stall)
                rows.append({"mode": "stages", "shape": shape, "mib": mib, "bytes": len(raw),
                             **{k: max(v) for k, v in worst.items()}})
                print(_line(rows[-1]), flush=True)
    return rows


class Labels:
    model, tenant, fingerprint = "unknown", "unknown", None


async def front(sizes: list[int], repeat: int, stub_url: str) -> list[dict[str, Any]]:
    """The front of the path as the gateway takes it (`kvgate.request.front`), on this loop."""
    from kvgate.api.routes import GATEWAY

    app = build_app(config(stub_url, 64 * MIB))
    gateway = app[GATEWAY]
    rt = gateway.runtime
    rows = []
    try:
        async with Ticker().running() as ticker:
            for shape, make in SHAPES.items():
                for mib in sizes:
                    raw, stalls = make(mib * MIB), []
                    for _ in range(repeat + 1):  # the first starts the worker processes
                        stall, _ = await worst_of(ticker, lambda body=raw: gateway.front.take(
                            body, Endpoint.CHAT, rt, Labels(),
                            identify=lambda: rt.directory.identify({}, "127.0.0.1"),
                            allow=lambda parsed, tenant: None))
                        stalls.append(stall)
                    rows.append({"mode": "front", "shape": shape, "mib": mib, "bytes": len(raw),
                                 "worst": max(stalls[1:]), "median": statistics.median(stalls[1:]),
                                 "first": stalls[0]})
                    print(_line(rows[-1]), flush=True)
    finally:
        gateway.front.close()
    return rows


def _client(conn: Connection, url: str) -> None:
    """The client process: builds each body asked for, posts it, answers the status."""
    import aiohttp

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            while True:
                ask = conn.recv()
                if ask is None:
                    return
                shape, size = ask
                raw = SHAPES[shape](size)
                conn.send(("ready", len(raw)))
                conn.recv()
                async with session.post(f"{url}/v1/chat/completions", data=raw,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    conn.send(("done", r.status))

    asyncio.run(run())


async def http(sizes: list[int], repeat: int, stub_url: str) -> list[dict[str, Any]]:
    """The whole path over real sockets, kvgate on this loop."""
    from aiohttp import web

    app = build_app(config(stub_url, 64 * MIB))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    ours, theirs = multiprocessing.Pipe()
    client = multiprocessing.get_context("spawn").Process(
        target=_client, args=(theirs, f"http://127.0.0.1:{port}"), daemon=True)
    client.start()
    loop = asyncio.get_running_loop()
    rows = []
    try:
        await asyncio.sleep(1.0)  # discovery finds the stub
        async with Ticker().running() as ticker:
            for shape in SHAPES:
                for mib in sizes:
                    stalls, statuses, size = [], [], 0
                    for _ in range(repeat):
                        ours.send((shape, mib * MIB))
                        _, size = await loop.run_in_executor(None, ours.recv)

                        async def post() -> Any:
                            ours.send("go")
                            return (await loop.run_in_executor(None, ours.recv))[1]

                        stall, status = await worst_of(ticker, post)
                        stalls.append(stall)
                        statuses.append(status)
                    rows.append({"mode": "http", "shape": shape, "mib": mib, "bytes": size,
                                 "worst": max(stalls), "median": statistics.median(stalls),
                                 "status": sorted(set(statuses))})
                    print(_line(rows[-1]), flush=True)
    finally:
        ours.send(None)
        client.join(10)
        await runner.cleanup()
    return rows


def _line(row: dict[str, Any]) -> str:
    figures = "  ".join(f"{k} {v * 1000:6.1f} ms" if isinstance(v, float) else f"{k} {v}"
                        for k, v in row.items() if k not in ("mode", "shape", "mib", "bytes"))
    return f"{row['mode']:6} {row['shape']:12} {row['mib']:3} MiB  {figures}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mode", nargs="+", default=["stages", "front", "http"],
                        choices=["stages", "front", "http"])
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with stub_upstream() as stub_url:
        if "stages" in args.mode:
            rows += await stages(args.sizes, args.repeat, stub_url)
        if "front" in args.mode:
            rows += await front(args.sizes, args.repeat, stub_url)
        if "http" in args.mode:
            rows += await http(args.sizes, args.repeat, stub_url)
    if args.json:
        args.json.write_text(orjson.dumps(
            {"cpus": os.cpu_count(), "load": os.getloadavg(), "rows": rows},
            option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    asyncio.run(main())
