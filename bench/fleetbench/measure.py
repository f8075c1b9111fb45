"""One run: a fresh fleet, one contender, one workload at one load; its figures out.

Every run starts its own replica processes (nothing inherited from the run before: no cached
prefix, no queue), then the contender's, then sends the workload from this process, open loop,
at its times × time_scale. The first `warmup_s` of arrivals fill the fleet (its KV cache and
queues) and are not counted; the figures are of the requests sent in the `duration_s` after.
A request without its first token `ttft_timeout_s` (simulated) after it was sent, or not
finished `timeout_s` after, is cancelled and counts as a timeout, so a run lasts at most
warmup + duration + timeout. The replicas' counters (over the whole run) are scraped before
and after, and their simulated clocks too: `sim_speed` is simulated seconds × time_scale per
wall second, 1.0 when a replica kept pace with the wall clock, lower when it was starved of
CPU (or its step timer overshot) and so ran slower than modelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.tools.workload import Result, WorkItem, run_workload

from . import capacity, contenders, fleet, metrics
from .processes import ChildFailed, Children, cpu_seconds, free_port
from .workloads import Workload


@dataclass(frozen=True, slots=True)
class RunSpec:
    workload: Workload
    load: float  # multiple of the fleet's capacity
    rate_per_s: float  # simulated
    contender: contenders.Contender
    repeat: int
    seed: int
    warmup_s: float  # simulated, of arrivals not counted
    duration_s: float  # simulated, of arrivals counted
    ttft_timeout_s: float  # simulated, per request: until its first token
    timeout_s: float  # simulated, per request: until its end
    time_scale: float

    @property
    def run_id(self) -> str:
        return f"{self.workload.name}-{self.load:g}x-{self.contender.name}-r{self.repeat}"


async def run(spec: RunSpec, items: list[WorkItem], logs: Path) -> dict[str, Any]:
    """Measure one run (`logs`: an existing folder for its processes' logs and files); a
    contender that cannot start gives {"error": why} instead of figures."""
    record: dict[str, Any] = {"workload": spec.workload.name, "load": spec.load,
                              "rate_per_s": spec.rate_per_s, "contender": spec.contender.name,
                              "repeat": spec.repeat}  # fmt: skip
    why = contenders.available(spec.contender, spec.workload)
    if why is not None:
        return {**record, "error": why}
    ports = {name: free_port() for name in fleet.REPLICAS}
    events = ({name: (free_port(), free_port()) for name in fleet.REPLICAS}
              if spec.workload.kv_events else None)  # fmt: skip
    replicas = fleet.replicas(ports, spec.time_scale, spec.workload.output_lengths,
                              events_ports=events)  # fmt: skip
    if spec.contender.vllm_priority:  # vLLM's --scheduling-policy priority
        for replica in replicas:
            replica.settings["scheduling_policy"] = "priority"
    wall_items = [dataclasses.replace(i, at_s=i.at_s * spec.time_scale) for i in items]
    running: contenders.Running | None = None
    started = time.monotonic()
    async with Children(logs) as children, aiohttp.ClientSession() as http:
        try:
            for replica in replicas:
                children.start(f"sim-{replica.name}", [
                    sys.executable, "-m", "kvgate.cli", "sim",
                    "--fleet", str(fleet.fleet_file(replica, logs))])  # fmt: skip
            for replica in replicas:
                await children.wait_ready(http, f"sim-{replica.name}", replica.url + "/health")
            running = await contenders.start(spec.contender, children, http, replicas,
                                             spec.workload, spec.time_scale,
                                             f"{spec.run_id}-{id(logs):x}")  # fmt: skip
            ready_s = time.monotonic() - started
            gateways = ([] if spec.contender.kind != "kvgate" else
                        sorted({url for urls in running.targets.values() for url in urls}))
            waits_before = await _queue_waits(http, gateways)
            errors_before = await _queue_waits(http, gateways, metrics.parse_estimate_errors)
            before = await _scrape(http, replicas)
            cpu_before = _cpu(children)
            results = await run_workload(
                "", wall_items, targets=running.targets, tenant_header=running.tenant_header,
                timeout_s=spec.timeout_s * spec.time_scale,
                first_token_timeout_s=spec.ttft_timeout_s * spec.time_scale,
            )  # fmt: skip
            after = await _scrape(http, replicas)
            waits_after = await _queue_waits(http, gateways)
            errors_after = await _queue_waits(http, gateways, metrics.parse_estimate_errors)
            cpu_after = _cpu(children)
        except ChildFailed as exc:
            return {**record, "error": str(exc)}
        except aiohttp.ClientError as exc:  # a replica or the contender went away mid-run
            return {**record, "error": f"{exc}\n{children.exited()}".strip()}
        finally:
            if running is not None and running.redis_prefix is not None:
                with contextlib.suppress(Exception):  # a cleanup failure must not hide a result
                    record["redis_keys_cleaned"] = await asyncio.to_thread(
                        contenders.clean_redis, running.redis_prefix)  # fmt: skip
    elapsed = time.monotonic() - started
    counted = [r for r, item in zip(results, items, strict=True) if item.at_s >= spec.warmup_s]
    sim_results = metrics.to_simulated(counted, spec.time_scale)
    counters = metrics.increase(before["counters"], after["counters"])
    walls = after["wall"] - before["wall"]
    speed = {name: round((after["sim_time"][name] - before["sim_time"][name]) * spec.time_scale
                         / walls, 3) for name in after["sim_time"]}  # fmt: skip
    record.update(metrics.figures(sim_results, spec.duration_s, counters, _floor(replicas)))
    if gateways:
        record["critical_queued"] = metrics.queued(
            metrics.increase(waits_before, waits_after), spec.time_scale)
        record["wait_estimate_error"] = metrics.estimate_error(
            metrics.increase(errors_before, errors_after), spec.time_scale)
    record["run"] = {
        "requests_sent": len(items), "startup_wall_s": round(ready_s, 2),
        "wall_s": round(elapsed, 2),
        "sim_speed": speed, "sim_speed_min": min(speed.values()),
        "cpu_s": {name: round(cpu_after[name] - cpu_before[name], 2) for name in cpu_after},
    }  # fmt: skip
    if spec.load == 2:  # for the TTFT CDF: every short request counts, completed or not
        record["samples"] = {
            "short_requests": sum(r.kind == "short" for r in sim_results),
            "short_ttft_s": sorted(round(r.ttft_s, 4) for r in sim_results if r.kind == "short"
                                   and r.status == 200 and r.ttft_s is not None),
        }  # fmt: skip
    return record


def _floor(replicas: list[fleet.Replica]) -> Callable[[Result], float | None]:
    """A completed request's first-token floor on the pool its kind goes to (the
    prompt's tokens from its usage; None without them)."""
    by_pool = {r.pool: r for r in reversed(replicas)}  # each pool's first replica

    @functools.cache
    def floor_s(pool: str, tokens: int) -> float:
        return capacity.first_token_floor_s(by_pool[pool], tokens)

    def floor(result: Result) -> float | None:
        if result.prompt_tokens is None:
            return None
        return floor_s("long" if result.kind == "long" else "default", result.prompt_tokens)

    return floor


async def _scrape(http: aiohttp.ClientSession, replicas: list[fleet.Replica]) -> dict[str, Any]:
    counters: dict[str, float] = {}
    sim_time: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=10)
    for replica in replicas:
        async with http.get(replica.url + "/metrics", timeout=timeout) as response:
            for name, value in metrics.parse_counters(await response.text()).items():
                counters[name] = counters.get(name, 0.0) + value
        async with http.get(replica.url + "/sim/state", timeout=timeout) as response:
            sim_time[replica.name] = float((await response.json())["sim_time_s"])
    return {"counters": counters, "sim_time": sim_time, "wall": time.monotonic()}


async def _queue_waits(
    http: aiohttp.ClientSession, gateways: list[str],
    parse: Callable[[str], dict[str, float]] = metrics.parse_queue_waits,
) -> dict[str, float]:
    """The critical class's queue-wait buckets (or what `parse` reads), summed over the
    kvgate instances."""
    buckets: dict[str, float] = {}
    for url in gateways:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            for le, n in parse(await response.text()).items():
                buckets[le] = buckets.get(le, 0.0) + n
    return buckets


def _cpu(children: Children) -> dict[str, float]:
    out = {name: cpu_seconds(pid) for name, pid in children.pids().items()}
    out["load-generator"] = time.process_time()
    return out
