"""What `kvgate top` shows: one frame, drawn from a snapshot of a kvgate's `/admin/replicas` and
`/metrics`. Pure: the command fetches, this module lays out (rich renderables), so a frame is
testable without a terminal or a server.

A frame: a header, one row per replica (bars for reserved / written / vLLM-reported KV usage,
vLLM's queue, headroom, health and circuit), then totals per pool and per tenant. Rates (per
second) need two snapshots; the first frame shows totals only.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

BAR_WIDTH = 12
TOO_MANY_REQUESTS = {"rate_limited", "concurrency_limit", "queue_full", "queue_timeout",
                     "wait_budget_exceeded"}  # fmt: skip

Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class Snapshot:
    url: str
    replicas: list[dict[str, Any]]
    samples: Samples
    at: float = field(default_factory=time.monotonic)

    @classmethod
    def parse(cls, url: str, replicas: dict[str, Any], metrics: str, at: float) -> Snapshot:
        samples: Samples = defaultdict(list)
        for family in text_string_to_metric_families(metrics):
            for sample in family.samples:
                samples[sample.name].append((sample.labels, sample.value))
        return cls(url, list(replicas.get("replicas", [])), dict(samples), at)

    def value(self, name: str, **labels: str) -> float | None:
        for sample_labels, value in self.samples.get(name, []):
            if labels.items() <= sample_labels.items():
                return value
        return None

    def by(self, name: str, label: str, where: Iterable[tuple[str, set[str]]] = ()) -> dict[str, float]:
        """The sum of a metric's samples per value of `label`, keeping only samples whose
        other labels are in the given sets."""
        out: dict[str, float] = defaultdict(float)
        conditions = list(where)
        for labels, value in self.samples.get(name, []):
            if label in labels and all(labels.get(k) in values for k, values in conditions):
                out[labels[label]] += value
        return dict(out)


def bar(used: float | None, total: float | None, style: str) -> Text:
    if used is None or not total or used != used:  # unknown, or NaN (stale)
        return Text("?".center(BAR_WIDTH + 5), style="dim")
    ratio = max(0.0, min(1.0, used / total))
    filled = round(ratio * BAR_WIDTH)
    text = Text("█" * filled, style="red" if ratio >= 0.9 else style)
    text.append("░" * (BAR_WIDTH - filled), style="dim")
    text.append(f" {ratio:4.0%}")
    return text


def _number(value: float | None, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}{suffix}" if abs(value) >= 10 or value == int(value) else f"{value:.1f}{suffix}"


def _rate(now: Snapshot, before: Snapshot | None, name: str, label: str, key: str,
          where: Iterable[tuple[str, set[str]]] = ()) -> str:
    """Per second between two snapshots, of one value of `label` of a counter."""
    if before is None or now.at <= before.at:
        return "-"
    conditions = list(where)
    step = now.by(name, label, conditions).get(key, 0.0) - before.by(
        name, label, conditions).get(key, 0.0)
    return _number(max(0.0, step) / (now.at - before.at), "/s")


def replica_table(snap: Snapshot) -> Table:
    table = Table(title="replicas", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("replica", "pool", "health", "circuit", "reserved", "written", "vLLM",
                   "queue", "headroom", "in flight"):
        table.add_column(column, justify="right" if column in ("queue", "headroom",
                                                               "in flight") else "left")
    for r in sorted(snap.replicas, key=lambda r: (r.get("pool", ""), r.get("id", ""))):
        total = r.get("num_gpu_blocks")
        vllm = r.get("vllm") or {}
        usage = vllm.get("kv_usage")
        health = Text("up", style="green") if r.get("healthy") else Text("DOWN", style="bold red")
        if r.get("draining"):
            health.append(" draining", style="yellow")
        circuit = r.get("circuit")
        circuit_text = Text(circuit or "-", style="red" if circuit == "open" else
                            "yellow" if circuit == "half_open" else "")
        table.add_row(
            str(r.get("id")), str(r.get("pool")), health, circuit_text,
            bar(r.get("reserved_blocks"), total, "yellow"),
            bar(r.get("written_blocks"), total, "green"),
            bar(None if usage is None else usage * (total or 0), total, "cyan"),
            _number(vllm.get("waiting")), headroom(snap, r), _number(r.get("inflight")),
        )
    return table


def headroom(snap: Snapshot, replica: dict[str, Any]) -> str:
    """Requests of the recent p95 size that still fit, at predicted demand / at the worst case:
    from /admin/replicas, else from /metrics."""
    given = replica.get("headroom_requests")
    figures = []
    for basis in ("predicted", "worst_case"):
        if isinstance(given, dict):
            value = given.get(basis)
        else:
            value = snap.value("kvgate_replica_headroom_requests",
                               replica=str(replica.get("id")), basis=basis)
        figures.append(_number(value))
    return " / ".join(figures)


def pool_table(snap: Snapshot, before: Snapshot | None) -> Table:
    table = Table(title="pools", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("pool", "replicas up", "kv reserved", "queued", "requests", "req/s",
                   "refused"):
        table.add_column(column, justify="left" if column == "pool" else "right")
    depth = snap.by("kvgate_queue_depth", "pool")
    requests = snap.by("kvgate_requests_total", "pool")
    refused = snap.by("kvgate_refusals_total", "pool")
    pools: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in snap.replicas:
        pools[str(r.get("pool"))].append(r)
    for pool in sorted(set(pools) | set(depth)):
        members = pools.get(pool, [])
        up = sum(1 for r in members if r.get("healthy"))
        reserved = sum(r.get("reserved_blocks") or 0 for r in members)
        capacity = sum(r.get("num_gpu_blocks") or 0 for r in members)
        table.add_row(pool, f"{up}/{len(members)}", bar(reserved, capacity, "yellow"),
                      _number(depth.get(pool)), _number(requests.get(pool, 0.0)),
                      _rate(snap, before, "kvgate_requests_total", "pool", pool),
                      _number(refused.get(pool, 0.0)))
    return table


def tenant_table(snap: Snapshot, before: Snapshot | None) -> Table:
    table = Table(title="tenants", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("tenant", "tokens", "tokens/s", "429s", "budget left", "in flight"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    actual = [("kind", {"prompt", "completion"})]
    tokens = snap.by("kvgate_tenant_tokens_total", "tenant", actual)
    limited = snap.by("kvgate_refusals_total", "tenant", [("reason", TOO_MANY_REQUESTS)])
    remaining = snap.by("kvgate_tenant_remaining_tokens", "tenant")
    inflight = snap.by("kvgate_tenant_concurrent_requests", "tenant")
    for tenant in sorted(set(tokens) | set(limited) | set(remaining) | set(inflight)):
        table.add_row(tenant, _number(tokens.get(tenant, 0.0)),
                      _rate(snap, before, "kvgate_tenant_tokens_total", "tenant", tenant, actual),
                      _number(limited.get(tenant, 0.0)), _number(remaining.get(tenant)),
                      _number(inflight.get(tenant, 0.0)))
    return table


def frame(snap: Snapshot, before: Snapshot | None = None) -> RenderableType:
    """One screen of `kvgate top`. `before`: the previous snapshot, for rates."""
    up = sum(1 for r in snap.replicas if r.get("healthy"))
    header = Text(f"kvgate top  {snap.url}  {time.strftime('%H:%M:%S')}  ", style="bold")
    header.append(f"{up}/{len(snap.replicas)} replicas up", style="green" if up else "red")
    legend = Text("bars: share of each replica's KV blocks: reserved (worst case) · written "
                  "(this instance's requests) · vLLM-reported; queue: vLLM's waiting requests; "
                  "headroom: requests of the recent p95 size that still fit, at predicted "
                  "demand / at the worst case", style="dim")
    return Group(header, replica_table(snap), pool_table(snap, before),
                 tenant_table(snap, before), legend)
