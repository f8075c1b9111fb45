"""What prompt normalization costs per request, and what it buys in prefix-cache hits.

Cost: the normalization stage (normalize, fingerprint, drift tracking) on chat requests that
need no edit and on noisy ones, timed in batches in this process; reported as the median
microseconds per request over the batches, beside the parse it follows (orjson.loads and
validation) for scale.

Hits: the noisy workload (kvgate/tools/noisy.py: a timestamp in the system prompt's first
line, CRLF half the time, random trailing blanks, tool JSON in random key order) sent through
kvgate to one simulated replica with normalization off, then on (timestamps relocated), and the
same prompts sent clean; the replica's own vllm:prefix_cache_hits / queries for each.

    .venv/bin/python bench/normalize.py [--batches 200] [--batch 200] [--requests 48]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvgate.app import build_app
from kvgate.config import Config, TenantConfig, parse_config
from kvgate.metrics import Metrics
from kvgate.normalize.stage import PromptStage
from kvgate.request.parsed import Endpoint, ParsedRequest, parse_body
from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.config import SimConfig
from kvgate.sim.server import SimReplica
from kvgate.tools.noisy import clean_chats, noisy_chats

RELOCATE = {"rules": {"relocate_dynamic": True}, "relocate": {"patterns": ["timestamp"]}}


def per_request_us(call: Callable[[], object], batches: int, batch: int) -> float:
    """Median over batches of the mean time of one call, in microseconds."""
    for _ in range(batch):  # warm up: caches, branch predictors, the tracker's entries
        call()
    samples = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(batch):
            call()
        samples.append((time.perf_counter_ns() - start) / batch / 1000)
    return statistics.median(samples)


def cost(batches: int, batch: int) -> list[tuple[str, float]]:
    rows = []
    for label, normalization in [("safe rules (default)", {}), ("safe + relocation", RELOCATE)]:
        rows += stage_cost(label, normalization, batches, batch)
    raw = orjson.dumps(clean_chats(1)[0])
    rows.append(("for scale: parse_body of the same request",
                 per_request_us(lambda: parse_body(raw, Endpoint.CHAT), batches, batch)))
    return rows


def stage_cost(label: str, normalization: dict[str, Any], batches: int, batch: int
               ) -> list[tuple[str, float]]:  # fmt: skip
    tenant = TenantConfig(name="bench")
    config = config_for("http://127.0.0.1:1", normalization)
    stage = PromptStage(Metrics())
    clean = parsed_chat(clean_chats(1)[0])
    noisy = iter([parsed_chat(body) for body in noisy_chats(batch, seed=3)] * (batches + 2))
    return [
        (f"{label}: request needing no edit",
         per_request_us(lambda: stage.apply(clean, tenant, config), batches, batch)),
        (f"{label}: noisy request",
         per_request_us(lambda: stage.apply(next(noisy), tenant, config), batches, batch)),
    ]


def parsed_chat(body: dict[str, Any]) -> ParsedRequest:
    return parse_body(orjson.dumps(body), Endpoint.CHAT)


def config_for(url: str, normalization: dict[str, Any]) -> Config:
    return parse_config({
        "pools": {"default": {"replicas": [{"url": url}]}},
        "discovery": {"interval_s": 0.2},
        "normalization": normalization,
    })


async def hit_rate(bodies: list[dict[str, Any]], normalization: dict[str, Any]) -> float:
    replica = SimReplica(SimConfig(time_scale=0.01, max_model_len=4096), tokenizer=load_tiktoken())
    await replica.start()
    runner = web.AppRunner(build_app(config_for(replica.url, normalization)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            for body in bodies:
                for _ in range(100):  # until discovery has found the replica (at most 10 s)
                    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                        await response.read()
                        if response.status == 200:
                            break
                    await asyncio.sleep(0.1)
        stats = replica.engine.stats
        return stats.prefix_cache_hits / stats.prefix_cache_queries
    finally:
        await runner.cleanup()
        await replica.stop()


async def hits(requests: int) -> list[tuple[str, float]]:
    noisy = noisy_chats(requests, seed=1)
    return [
        ("noisy, normalization off", await hit_rate(noisy, {"enabled": False})),
        ("noisy, normalization on (+ timestamps relocated)", await hit_rate(noisy, RELOCATE)),
        ("the same prompts sent clean", await hit_rate(clean_chats(requests), {"enabled": False})),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--requests", type=int, default=48, help="requests per hit-rate run")
    args = parser.parse_args()
    logging.getLogger("kvgate").setLevel(logging.ERROR)  # the drift lines, expected here
    print("normalization stage, median microseconds per request:")
    for label, us in cost(args.batches, args.batch):
        print(f"  {label:58} {us:8.2f}")
    print(f"\nprefix-cache hit rate of one simulated replica, {args.requests} requests each:")
    rates = asyncio.run(hits(args.requests))
    for label, rate in rates:
        print(f"  {label:58} {rate:8.3f}")
    off, on, clean = (rate for _, rate in rates)
    print(f"\n  on / clean = {on / clean:.3f} (target >= 0.9); off / clean = {off / clean:.3f} "
          "(target <= 0.333)")


if __name__ == "__main__":
    main()
