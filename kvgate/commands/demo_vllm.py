"""`kvgate demo --vllm`: the demo's fleet as real vLLM engines (vLLM's CPU build serving the
tiny generated model, kvgate.tools.vllm_cpu) instead of the simulator.

The same three replicas: two normal engines and one long-context engine. They start once
(about 25 s) and serve every column of `--workload`; between columns each drops its prefix
cache (vLLM's `/reset_prefix_cache`, served in its dev mode), and a column's figures are the
differences of the engines' own counters over its run. Times are wall seconds: a CPU's pace,
not a GPU's (docs/real-vllm.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvgate.tools.tiny_model import MODEL_NAME
from kvgate.tools.vllm_cpu import Engine, EngineSpec, read_series, running

# dev_mode: each column starts by dropping the engines' prefix caches (/reset_prefix_cache)
# Each engine bound to a core (the long one shares the first): unbound, their threads contend.
SPECS = {
    "normal-a": EngineSpec(num_blocks=256, max_model_len=4096, cpus="0", dev_mode=True),
    "normal-b": EngineSpec(num_blocks=256, max_model_len=4096, cpus="1", dev_mode=True),
    "long": EngineSpec(num_blocks=1024, max_model_len=8192, max_num_batched_tokens=4096,
                       cpus="0", dev_mode=True),
}
# A long document's words: 4-6k tokens of this model's small vocabulary (the simulated demo's
# 3,500-5,000 words are 22-31k tokens here, whose prefill takes a CPU core half a minute).
LONG_WORDS = (700, 1000)
COUNTERS = {"preemptions": "vllm:num_preemptions_total",
            "prefix_cache_hits": "vllm:prefix_cache_hits_total",
            "prefix_cache_queries": "vllm:prefix_cache_queries_total",
            "finished": "vllm:request_success_total"}  # fmt: skip
LOAD = ["vllm:num_requests_running", "vllm:num_requests_waiting"]


@dataclass
class RealFleet:
    """The running engines by name, and their counters when the current column began."""

    engines: dict[str, Engine]
    baseline: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return MODEL_NAME

    def url(self, name: str) -> str:
        return self.engines[name].url

    def tokenizer_file(self) -> str:
        return str(next(iter(self.engines.values())).model_dir / "tokenizer.json")

    async def fresh(self) -> None:
        """A new column: every engine's prefix cache dropped, its counters read as the start."""
        async with aiohttp.ClientSession() as http:
            for engine in self.engines.values():
                async with http.post(f"{engine.url}/reset_prefix_cache") as response:
                    await response.read()
            self.baseline = {n: await _counters(http, e) for n, e in self.engines.items()}

    async def stats(self) -> dict[str, dict[str, Any]]:
        """Each engine's counters over the column: as the simulated fleet reports them."""
        out = {}
        async with aiohttp.ClientSession() as http:
            for name, engine in self.engines.items():
                now = await _counters(http, engine)
                delta = {k: now[k] - self.baseline.get(name, {}).get(k, 0.0) for k in COUNTERS}
                queries = delta["prefix_cache_queries"]
                out[name] = {
                    "finished": int(delta["finished"]),
                    "preemptions": int(delta["preemptions"]),
                    "prefix_hit_rate": round(delta["prefix_cache_hits"] / queries, 3)
                    if queries else None,
                    "prefix_cache_hits": int(delta["prefix_cache_hits"]),
                    "prefix_cache_queries": int(queries),
                }
        return out

    def describe(self) -> list[str]:
        return [f"  {name:9} {e.url}  {e.spec.num_blocks} blocks of {e.spec.block_size}, "
                f"max_model_len {e.spec.model_len} (vLLM's CPU build)"
                for name, e in self.engines.items()]


@contextlib.asynccontextmanager
async def real_fleet() -> AsyncIterator[RealFleet]:
    """The demo's three engines, started together and stopped on the way out."""
    async with running(list(SPECS.values())) as engines:
        yield RealFleet(dict(zip(SPECS, engines, strict=True)))


async def _counters(http: aiohttp.ClientSession, engine: Engine) -> dict[str, float]:
    found = await read_series(http, engine.url, list(COUNTERS.values()))
    return {key: found[series] for key, series in COUNTERS.items()}


async def settle(fleet: RealFleet, timeout_s: float = 60.0) -> None:
    """Until no engine runs or queues anything: a column's stragglers never count in the next."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as http:
        while loop.time() < deadline:
            busy = 0.0
            for engine in fleet.engines.values():
                busy += sum((await read_series(http, engine.url, LOAD)).values())
            if not busy:
                return
            await asyncio.sleep(0.2)
