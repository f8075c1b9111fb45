"""The fleet benchmark on real engines: two vLLM CPU engines serving the tiny model, started
once per invocation and shared by every run (they take 20-40 s to start; the simulated
fleet's replicas are restarted per run instead).

What keeps runs apart on shared engines: before each run every engine is idle (nothing running
or waiting) and its prefix cache is reset (vLLM's dev endpoint, so `VLLM_SERVER_DEV_MODE=1`);
the contender's own processes are fresh. Times are wall seconds (no time_scale).

    build_chats     seeded open-loop short chats (Poisson), answers ending on EOS
    build_burst     N chats sent within a few seconds
    capacity        the engines' saturated throughput, direct round robin, flooded
    run             one contender, one list of chats: figures out
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.tools import vllm_cpu
from kvgate.tools.tiny_model import MODEL_NAME
from kvgate.tools.workload import Result, WorkItem, percentile, run_workload

from . import contenders, metrics
from .fleet import Replica
from .processes import Children
from .prompts import words
from .workloads import Workload

NUM_BLOCKS, BLOCK_SIZE, MAX_TOKENS = 256, 32, 1024
VIP_SHARE = 0.1  # critical; the rest chat-app (standard)
SYSTEM = "You are a helpful assistant. Answer the question briefly and precisely."
# Words of the user's question: the tiny model's tokenizer counts about 4.4 tokens a word, so
# a chat's prompt (system prompt and template included) is about 100-300 tokens.
QUESTION_WORDS = (14, 58)
BURST_WORDS = 24  # about 150 tokens a prompt
SETTLE_TIMEOUT_S = 180.0
COUNTERS = (*metrics.COUNTERS, "vllm:request_success_total")


def chat(rng: random.Random, at: float, question_words: int) -> WorkItem:
    tenant = "vip" if rng.random() < VIP_SHARE else "chat-app"
    # No per-request `seed` (which would give every contender the same answer lengths): with
    # it, vLLM CPU 0.32's engine core died (EngineDeadError) under 40 concurrent chats each.
    body = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": words(rng, question_words) + "?"}]}
    return WorkItem(at, "short", tenant, body)  # fmt: skip


def build_chats(seed: int, duration_s: float, rate: float) -> list[WorkItem]:
    """Poisson arrivals at `rate` per second for `duration_s`; answers end on EOS (the tiny
    model's: about 384 tokens on average, geometric), max_tokens 1,024."""
    rng = random.Random(seed)
    items, at = [], rng.expovariate(rate)
    while at < duration_s:
        items.append(chat(rng, at, rng.randint(*QUESTION_WORDS)))
        at += rng.expovariate(rate)
    return items


def build_burst(seed: int, count: int, spread_s: float) -> list[WorkItem]:
    """`count` chats of about 150 prompt tokens, sent at uniform times within `spread_s`."""
    rng = random.Random(seed)
    times = sorted(rng.uniform(0, spread_s) for _ in range(count))
    return [chat(rng, at, BURST_WORDS) for at in times]


CHATS = Workload("chats", build_chats, 1 << 30, {}, warmup_s=0.0, duration_s=0.0,
                 time_scale=1.0,
                 describe="short chats, 10% vip (critical), the rest chat-app (standard); "
                          "prompts about 100-300 tokens, max_tokens 1,024, answers end on the "
                          "tiny model's EOS (about 384 tokens on average)")  # fmt: skip


def specs(cores: str) -> list[vllm_cpu.EngineSpec]:
    """Two engines of 256 blocks of 32 tokens; `cores` "pinned" (one core each) or
    "unpinned" (both may use both cores)."""
    # dev mode: /reset_prefix_cache between runs
    spec = vllm_cpu.EngineSpec(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dev_mode=True)
    return vllm_cpu.pinned([spec, spec]) if cores == "pinned" else [spec, spec]


@contextlib.asynccontextmanager
async def engines(cores: str) -> Any:
    async with vllm_cpu.running(specs(cores)) as started:
        yield started


def replicas(started: list[vllm_cpu.Engine]) -> list[Replica]:
    return [Replica(f"engine-{n}", "default", e.port, {}) for n, e in enumerate(started)]


def models(started: list[vllm_cpu.Engine]) -> list[dict[str, Any]]:
    """kvgate's `models`: the engines' own tokenizer and chat template."""
    tokenizer = started[0].model_dir / "tokenizer.json"
    return [{"name": MODEL_NAME, "tokenizer": {"kind": "huggingface", "file": str(tokenizer)}}]


async def scrape(http: aiohttp.ClientSession, started: list[vllm_cpu.Engine],
                 names: tuple[str, ...] = COUNTERS) -> dict[str, float]:  # fmt: skip
    """The engines' counters (or gauges), each summed over the engines."""
    sums: dict[str, float] = {}
    for engine in started:
        async with http.get(engine.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            for name, value in metrics.parse_counters(await r.text(), names).items():
                sums[name] = sums.get(name, 0.0) + value
    return sums


async def settle(http: aiohttp.ClientSession, started: list[vllm_cpu.Engine]) -> float:
    """Until no engine runs or queues a request, then reset every prefix cache; seconds it
    took (a run's cancelled requests are aborted in vLLM a little after the client leaves)."""
    began = time.monotonic()
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    while sum((await scrape(http, started, gauges)).values()) > 0:
        if time.monotonic() - began > SETTLE_TIMEOUT_S:
            raise RuntimeError(f"engines still busy after {SETTLE_TIMEOUT_S:g} s")
        await asyncio.sleep(0.2)
    for engine in started:
        while True:
            async with http.post(engine.url + "/reset_prefix_cache") as r:
                if r.status == 200 and (await r.json()).get("success"):
                    break
            await asyncio.sleep(0.2)
    return round(time.monotonic() - began, 2)


async def capacity(started: list[vllm_cpu.Engine], seed: int, count: int) -> dict[str, Any]:
    """The engines' saturated throughput on the chats: `count` of them sent at once, round
    robin; the rate at which they completed between the 10th and the 90th percentile of
    completions (the ramp-up and the emptying tail left out), as fleetbench/capacity.py
    measures the simulator. Preemption costs are in it, as the engines have them."""
    items = build_chats(seed, 2.0 * count, 1.0)[:count]  # ~2 x count of them at 1 per s
    items = [WorkItem(0.0, i.kind, i.tenant, i.body) for i in items]
    async with aiohttp.ClientSession() as http:
        await settle(http, started)
        quiet_wait_s = await quiet()
        before = await scrape(http, started)
        cpu_before = cpu()
        began = time.monotonic()
        results = await run_workload("", items, targets={"short": [e.url for e in started]},
                                     tenant_header=None, timeout_s=600)  # fmt: skip
        wall = time.monotonic() - began
        after = await scrape(http, started)
        cpu_after = cpu()
    ends = sorted(r.sent_s + r.e2e_s for r in results
                  if r.status == 200 and r.sent_s is not None and r.e2e_s is not None)  # fmt: skip
    if len(ends) < 10:
        raise RuntimeError(f"capacity: {len(ends)} of {count} chats completed: "
                           f"{Counter(metrics.outcome(r) for r in results)}")
    low, high = ends[len(ends) // 10], ends[(len(ends) * 9) // 10]
    done = [r for r in results if r.status == 200]
    rate = ((len(ends) * 9) // 10 - len(ends) // 10) / (high - low)
    return {"requests": count, "completed": len(done), "wall_s": round(wall, 1),
            "requests_per_s": round(rate, 3),
            "output_tokens_per_s": round(sum(r.output_tokens or 0 for r in done) / wall, 1),
            "output_tokens_mean": round(statistics.fmean(r.output_tokens or 0 for r in done), 1),
            "prompt_tokens_p50": percentile(sorted(r.prompt_tokens or 0 for r in done), 0.5),
            "preemptions": int(after["vllm:num_preemptions_total"]
                               - before["vllm:num_preemptions_total"]),
            "quiet_wait_s": quiet_wait_s, "cpu": cpu_use(cpu_before, cpu_after, wall),
            "method": f"{count} chats sent at once, round robin over the engines; completions "
                      "per second between the 10th and the 90th percentile of completion "
                      "times"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Run:
    part: str  # "burst" or "load"
    load: float  # multiple of capacity (0 for the burst)
    contender: contenders.Contender
    repeat: int
    items: list[WorkItem]
    counted_from_s: float  # arrivals before this are sent, not counted
    duration_s: float  # of counted arrivals: goodput's denominator
    ttft_timeout_s: float | None
    timeout_s: float


async def run(spec: Run, started: list[vllm_cpu.Engine], logs: Path) -> dict[str, Any]:
    """One contender in front of the (idle, cache-reset) engines; its figures."""
    record: dict[str, Any] = {"workload": spec.part, "load": spec.load,
                              "contender": spec.contender.name, "repeat": spec.repeat}  # fmt: skip
    why = contenders.available(spec.contender, CHATS)
    if why is not None:
        return {**record, "error": why}
    await asyncio.to_thread(logs.mkdir, parents=True, exist_ok=True)
    fleet = replicas(started)
    async with Children(logs) as children, aiohttp.ClientSession() as http:
        settle_s = await settle(http, started)
        quiet_wait_s = await quiet()
        begun = time.monotonic()
        running = await contenders.start(spec.contender, children, http, fleet, CHATS, 1.0,
                                         f"{record['workload']}-{spec.repeat}",
                                         models(started))  # fmt: skip
        ready_s = time.monotonic() - begun
        before = await scrape(http, started)
        cpu_before = cpu()
        results = await run_workload("", spec.items, targets=running.targets,
                                     tenant_header=running.tenant_header,
                                     timeout_s=spec.timeout_s,
                                     first_token_timeout_s=spec.ttft_timeout_s)  # fmt: skip
        wall = time.monotonic() - begun - ready_s
        after = await scrape(http, started)
        cpu_after = cpu()
    counted = [r for r, i in zip(results, spec.items, strict=True) if i.at_s >= spec.counted_from_s]
    record.update(metrics.figures(counted, spec.duration_s, metrics.increase(before, after)))
    record.update(whole_run(results, wall))
    record["run"] = {"requests_sent": len(spec.items), "settle_s": settle_s, "quiet_wait_s": quiet_wait_s,
                     "cpu": cpu_use(cpu_before, cpu_after, wall),
                     "startup_s": round(ready_s, 2), "wall_s": round(wall, 2),
                     "engine_successes": int(after["vllm:request_success_total"]
                                             - before["vllm:request_success_total"])}  # fmt: skip
    return record


def whole_run(results: list[Result], wall_s: float) -> dict[str, Any]:
    """Figures over every request sent (warm-up included): the makespan (first send to the
    last completed answer's end), output tokens per second of it, prompt and answer sizes."""
    done = [r for r in results if r.status == 200 and r.e2e_s is not None]
    first = min((r.sent_s for r in results if r.sent_s is not None), default=0.0)
    last = max((r.sent_s + r.e2e_s for r in done if r.sent_s is not None), default=first)
    makespan = last - first
    out = sum(r.output_tokens or 0 for r in done)
    return {"makespan_s": round(makespan, 2),
            "all_completed": len(done), "all_sent": len(results),
            "all_ttft_s": metrics.latency(r.ttft_s for r in done),
            "output_tokens_per_makespan_s": round(out / makespan, 1) if makespan else None,
            "output_tokens_mean": round(statistics.fmean(r.output_tokens or 0 for r in done), 1)
            if done else None,
            "prompt_tokens_p50": percentile(sorted(r.prompt_tokens or 0 for r in done), 0.5)
            if done else None}  # fmt: skip


def cpu() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process and its
    descendants: the engines, their workers, the contenders; exited children included)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = sum(fields) - fields[3] - fields[4]  # less idle and iowait
    parents: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(stat[1])
            times[int(entry.name)] = int(stat[11]) + int(stat[12])
    me = os.getpid()
    mine, frontier = {me}, [me]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in mine]
        mine.update(children)
        frontier.extend(children)
    reaped = sum(os.times()[2:4])  # children this process waited for (each run's contender)
    tick = os.sysconf("SC_CLK_TCK")
    return busy / tick, sum(times.get(pid, 0) for pid in mine) / tick + reaped


def cpu_use(before: tuple[float, float], after: tuple[float, float], wall_s: float,
            ) -> dict[str, float]:  # fmt: skip
    """Cores busy on average over a run: in all, of this benchmark, and of anything else on
    the machine (another user's processes: what makes the figures less trustworthy)."""
    machine, own = (after[0] - before[0]) / wall_s, (after[1] - before[1]) / wall_s
    return {"machine_cores": round(machine, 2), "own_cores": round(own, 2),
            "foreign_cores": round(max(0.0, machine - own), 2)}  # fmt: skip


async def quiet(threshold_cores: float = 0.3, sample_s: float = 2.0, limit_s: float = 60.0,
                ) -> float:  # fmt: skip
    """Wait (up to `limit_s`) until processes not this benchmark's use less than
    `threshold_cores` of the machine: the engines are idle now, so anything busy is someone
    else's. Seconds waited."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        before = await asyncio.to_thread(cpu)
        await asyncio.sleep(sample_s)
        after = await asyncio.to_thread(cpu)
        if cpu_use(before, after, sample_s)["foreign_cores"] < threshold_cores:
            break
    return round(time.monotonic() - began, 1)
