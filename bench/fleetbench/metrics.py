"""From one run's results and the replicas' counters to the figures reported: pure functions.

Every time here is in simulated seconds (`to_simulated` converts the load generator's wall
clock first). Goodput is requests per simulated second of the workload that completed with
their first token within target: a short request within 1 s or 2 s (both reported), a long
one within 10 s.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvgate.tools.workload import Result, goodput, percentile

SHORT_TTFT_SLOS_S = (1.0, 2.0)
LONG_TTFT_SLO_S = 10.0
CRITICAL_TENANT = "vip"
# Issue 20's target for the critical class's TTFT p99, judged against what an idle replica
# allows (`figures`' `floor`).
CRITICAL_TTFT_TARGET_S = 0.5
# The replicas' own counters, summed over the fleet.
COUNTERS = ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total", "vllm:generation_tokens_total")  # fmt: skip


def to_simulated(results: Iterable[Result], time_scale: float) -> list[Result]:
    """The same results with their times divided by the fleet's time_scale."""

    def sim(value: float | None) -> float | None:
        return None if value is None else value / time_scale

    return [dataclasses.replace(r, ttft_s=sim(r.ttft_s), e2e_s=sim(r.e2e_s), sent_s=sim(r.sent_s),
                                retry_after_s=sim(r.retry_after_s)) for r in results]  # fmt: skip


def outcome(result: Result) -> tuple[str, str]:
    """("completed" | "refused" | "failed", reason): a refusal is a 4xx, named by status and
    code; a failure is a 5xx, a dropped connection, an error mid-stream or a timeout."""
    if result.status == 200:
        return "completed", ""
    if 400 <= result.status < 500:
        return "refused", f"{result.status} {result.error_code}"
    if result.status >= 500:
        return "failed", f"{result.status} {result.error_code}"
    if result.error_code == "TimeoutError":
        return "failed", "timeout"
    if result.error_code == "stream_error":
        return "failed", "error mid-stream"
    return "failed", f"dropped ({result.error_code})"


def latency(values: Iterable[float | None]) -> dict[str, float | int | None]:
    ordered = sorted(v for v in values if v is not None)
    p50, p99 = percentile(ordered, 0.50), percentile(ordered, 0.99)
    return {"p50": _round(p50), "p99": _round(p99), "n": len(ordered)}


def figures(results: list[Result], duration_s: float, counters: dict[str, float],
            floor: Callable[[Result], float | None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Everything reported for one run (results in simulated seconds; `counters` the fleet's
    increase of COUNTERS over the run; `floor`: a completed request's TTFT on an idle replica,
    for `critical_floor`)."""
    outcomes: dict[str, Counter[str]] = {"completed": Counter(), "refused": Counter(),
                                         "failed": Counter()}  # fmt: skip
    for r in results:
        kind, reason = outcome(r)
        outcomes[kind][reason] += 1
    groups = {
        "short": [r for r in results if r.kind == "short"],
        "long": [r for r in results if r.kind == "long"],
        "critical": [r for r in results if r.tenant == CRITICAL_TENANT],
    }
    done = [r for r in results if r.status == 200]
    queries = counters.get("vllm:prefix_cache_queries_total", 0.0)
    retry_after = [r.retry_after_s for r in results if r.retry_after_s is not None]
    return {
        "requests": len(results),
        "completed": sum(outcomes["completed"].values()),
        "refused": dict(sorted(outcomes["refused"].items())),
        "failed": dict(sorted(outcomes["failed"].items())),
        "ttft_s": {g: latency(r.ttft_s for r in rs if r.status == 200) for g, rs in groups.items()},
        "e2e_s": {g: latency(r.e2e_s for r in rs if r.status == 200) for g, rs in groups.items()},
        "goodput_per_s": {
            f"short_ttft_{slo:g}s": _round(goodput(results, duration_s, short_ttft_s=slo,
                                                   long_ttft_s=LONG_TTFT_SLO_S))
            for slo in SHORT_TTFT_SLOS_S
        },
        "completed_per_s": _round(len(done) / duration_s),
        "output_tokens_per_s": _round(sum(r.output_tokens or 0 for r in done) / duration_s, 1),
        "preemptions": int(counters.get("vllm:num_preemptions_total", 0)),
        "prefix_cache_hit_rate": _round(
            counters.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries else None),
        "generation_tokens": int(counters.get("vllm:generation_tokens_total", 0)),
        "retry_after_s_median": _round(statistics.median(retry_after) if retry_after else None),
        "by_tenant": {tenant: by_tenant(results, tenant, duration_s)
                      for tenant in sorted({r.tenant for r in results})},
        **({} if floor is None else {"critical_floor": critical_floor(groups["critical"], floor)}),
    }  # fmt: skip


def critical_floor(results: list[Result], floor: Callable[[Result], float | None],
                   ) -> dict[str, Any]:  # fmt: skip
    """The completed critical requests' TTFT set against their floor (an idle replica's): the
    floors' spread, how many are above CRITICAL_TTFT_TARGET_S on their own, and the TTFT each
    had beyond its floor, the part that waiting (in a gateway or in vLLM) added."""
    pairs = [(r.ttft_s, f) for r in results
             if r.status == 200 and r.ttft_s is not None and (f := floor(r)) is not None]
    return {
        "floor_s": latency(f for _, f in pairs),
        "floor_above_target": sum(f > CRITICAL_TTFT_TARGET_S for _, f in pairs),
        "over_floor_s": latency(max(0.0, t - f) for t, f in pairs),
    }  # fmt: skip


def by_tenant(results: list[Result], tenant: str, duration_s: float) -> dict[str, Any]:
    """One tenant's requests: how they ended, and its goodput (short TTFT within 2 s)."""
    mine = [r for r in results if r.tenant == tenant]
    ended = Counter(outcome(r)[0] for r in mine)
    refused = Counter(outcome(r)[1] for r in mine if outcome(r)[0] == "refused")
    return {
        "requests": len(mine), "completed": ended["completed"], "refused": dict(refused),
        "failed": ended["failed"],
        "goodput_per_s": _round(goodput(mine, duration_s, short_ttft_s=SHORT_TTFT_SLOS_S[-1],
                                        long_ttft_s=LONG_TTFT_SLO_S)),
        "ttft_s": latency(r.ttft_s for r in mine if r.status == 200),
    }  # fmt: skip


def parse_counters(text: str, names: Iterable[str] = COUNTERS) -> dict[str, float]:
    """Sum each named sample over its label sets in Prometheus text exposition."""
    wanted = set(names)
    sums = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def parse_buckets(text: str, name: str, priority: str | None = None) -> dict[str, float]:
    """One of kvgate's histograms, summed over pools (and classes, or only `priority`'s):
    each bucket's upper bound (wall seconds, "+Inf" as is) to how many were no larger."""
    buckets: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                continue
            if priority is not None and sample.labels.get("priority") != priority:
                continue
            le = sample.labels["le"]
            buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


def parse_queue_waits(text: str, priority: str = "critical") -> dict[str, float]:
    """kvgate's `kvgate_queue_wait_seconds` buckets for one class."""
    return parse_buckets(text, "kvgate_queue_wait_seconds", priority)


def parse_estimate_errors(text: str) -> dict[str, float]:
    """kvgate's `kvgate_queue_wait_estimate_error_seconds` buckets, every class."""
    return parse_buckets(text, "kvgate_queue_wait_estimate_error_seconds")


def estimate_error(buckets: dict[str, float], time_scale: float) -> dict[str, Any]:
    """How far queued requests' waits were from kvgate's estimates (their wait less the
    estimate, simulated seconds): how many, and the bucket bounds at their 10th, 50th and
    90th percentiles (each the smallest bound that many were no larger than)."""
    bounds = sorted((float(le), n) for le, n in buckets.items())
    total = buckets.get("+Inf", 0.0)

    def quantile(q: float) -> float | None:
        for le, n in bounds:
            if n >= q * total:
                return None if le == float("inf") else _round(le / time_scale)
        return None

    return {"n": int(total), "p10": quantile(0.1), "p50": quantile(0.5), "p90": quantile(0.9)}


def queued(buckets: dict[str, float], time_scale: float,
           over_s: float = CRITICAL_TTFT_TARGET_S) -> dict[str, Any]:  # fmt: skip
    """How many of a class queued in kvgate at all, and how many waited there longer than
    `over_s` simulated seconds: the largest bucket bound within it, reported as it is."""
    bounds = sorted((float(le), n) for le, n in buckets.items() if le != "+Inf")
    within = [(le, n) for le, n in bounds if le / time_scale <= over_s]
    bound, n = within[-1] if within else (0.0, 0.0)
    total = buckets.get("+Inf", 0.0)
    return {"queued": int(total), "over_s": _round(bound / time_scale),
            "over": int(total - n)}


def increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
