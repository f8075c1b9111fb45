"""The Grafana dashboard for a kvgate fleet, generated from code: `deploy/grafana/kvgate.json`.

    python -m kvgate.tools.dashboard > deploy/grafana/kvgate.json

The dashboard is a list of rows; a row is a list of `Panel`s; a panel is a list of PromQL
`Target`s. Adding a graph is one line in `ROWS`. `tests/deploy/test_dashboard.py` checks that
the file is what this module generates and that every expression names only series and labels
kvgate or vLLM export.

Several kvgate instances export the same replica: figures read from the shared store (reserved
blocks, headroom, capacity) are aggregated with `max`, each instance's own (written blocks,
requests, refusals) with `sum` (see docs/metrics.md).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

UID = "kvgate-fleet"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
REPLICA = 'replica=~"$replica"'
POOL = 'pool=~"$pool"'
TENANT = 'tenant=~"$tenant"'
TOO_MANY_REQUESTS = "rate_limited|concurrency_limit|queue_full|queue_timeout|wait_budget_exceeded"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"
    width: int = 8
    repeat: str | None = None  # a variable: one copy of the panel per value
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # legend -> properties


def _quantiles(metric: str, by: str, matcher: str, qs: tuple[float, ...]) -> tuple[Target, ...]:
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{matcher}}}[{RATE}])))",
            f"{{{{{by}}}}} P{round(q * 100)}",
        )
        for q in qs
    )


def _of_capacity(expr: str) -> str:
    return f"{expr} / max by (replica) (kvgate_replica_capacity_blocks{{{REPLICA}}})"


KV_LINES = Panel(
    "KV cache of $replica: reserved, written, vLLM-reported",
    (
        Target(_of_capacity(f"max by (replica) (kvgate_replica_reserved_blocks{{{REPLICA}}})"),
               "reserved (worst case)"),
        Target(_of_capacity(f"sum by (replica) (kvgate_replica_written_blocks{{{REPLICA}}})"),
               "written"),
        Target(f"max by (replica) (kvgate_replica_vllm_kv_usage_ratio{{{REPLICA}}})",
               "vLLM-reported"),
        Target(_of_capacity(f"max by (replica) (kvgate_replica_admissible_blocks{{{REPLICA}}})"),
               "admissible limit"),
    ),
    unit="percentunit",
    description="Reserved is what kvgate promised (every request's worst case); written is what "
    "the requests have computed; vLLM-reported includes traffic kvgate never saw. vLLM high "
    "with written low is reservation, not saturation; headroom says what still fits.",
    width=12,
    repeat="replica",
    overrides={"admissible limit": {"custom.lineStyle": {"fill": "dash", "dash": [10, 10]},
                                    "color": {"mode": "fixed", "fixedColor": "red"}}},
)

ROWS: dict[str, list[Panel]] = {
    "KV cache per replica": [KV_LINES],
    "Replicas": [
        Panel("Headroom (requests of the pool's p95 size that still fit, at predicted demand "
              "and at the worst case)", (
            Target(f"min by (replica, basis) (kvgate_replica_headroom_requests{{{REPLICA}}})",
                   "{{replica}} {{basis}}"),)),
        Panel("vLLM waiting queue", (
            Target(f"max by (replica) (kvgate_replica_vllm_waiting_requests{{{REPLICA}}})",
                   "{{replica}}"),)),
        Panel("Preemptions per minute", (
            Target(f"max by (replica) (rate(kvgate_replica_vllm_preemptions_total{{{REPLICA}}}"
                   f"[{RATE}])) * 60", "{{replica}}"),)),
        Panel("Prefix-cache hit rate", (
            Target(f"max by (replica) (rate(kvgate_replica_vllm_prefix_cache_hit_tokens_total"
                   f"{{{REPLICA}}}[{RATE}])) / max by (replica) (rate("
                   f"kvgate_replica_vllm_prefix_cache_queried_tokens_total{{{REPLICA}}}[{RATE}]))",
                   "{{replica}}"),), unit="percentunit"),
        Panel("Healthy", (
            Target(f"min by (replica) (kvgate_replica_healthy{{{REPLICA}}})", "{{replica}}"),)),
        Panel("Circuit (0 closed, 1 half open, 2 open) and draining", (
            Target(f"max by (replica) (kvgate_replica_circuit_state{{{REPLICA}}})",
                   "circuit {{replica}}"),
            Target(f"max by (replica) (kvgate_replica_draining{{{REPLICA}}})",
                   "draining {{replica}}"))),
        Panel("Ledger divergence (vLLM − written, all instances)", (
            Target(f"max by (replica) (kvgate_replica_vllm_kv_usage_ratio{{{REPLICA}}}) - "
                   + _of_capacity(f"sum by (replica) (kvgate_replica_written_blocks{{{REPLICA}}})"),
                   "{{replica}}"),), unit="percentunit",
              description="Positive: blocks vLLM holds that kvgate does not see. Negative: "
              "kvgate counts more than vLLM holds (shared prefixes, preemptions)."),
    ],
    "Prompts": [
        Panel("Normalization edits per second, by rule", (
            Target(f"sum by (rule) (rate(kvgate_normalization_edits_total[{RATE}]))",
                   "{{rule}}"),)),
        Panel("Share of requests the normalizer modified", (
            Target(f'sum(rate(kvgate_normalization_requests_total{{result="modified"}}[{RATE}]))'
                   f" / sum(rate(kvgate_normalization_requests_total[{RATE}]))", "modified"),),
              unit="percentunit"),
        Panel("System-prompt changes (a deploy that edits a prompt is a step)", (
            Target("sum by (tenant, model) (kvgate_system_prompt_changes_total)",
                   "{{tenant}} {{model}}"),)),
    ],
    "Routing": [
        Panel("Session routes per second (hit, new, rebound by reason)", (
            Target(f"sum by (result, reason) (rate(kvgate_session_routes_total[{RATE}]))",
                   "{{result}} {{reason}}"),)),
        Panel("Prefix routes: share that ran on the prefix's replica", (
            Target(f'sum by (pool) (rate(kvgate_prefix_routes_total{{result="preferred"}}[{RATE}]))'
                   f" / sum by (pool) (rate(kvgate_prefix_routes_total[{RATE}]))", "{{pool}}"),),
              unit="percentunit"),
        Panel("Retries on another replica per second", (
            Target(f"sum by (pool, reason) (rate(kvgate_upstream_retries_total[{RATE}]))",
                   "{{pool}} {{reason}}"),)),
    ],
    "Pools": [
        Panel("Queue depth", (
            Target(f"sum by (pool) (kvgate_queue_depth{{{POOL}}})", "{{pool}}"),)),
        Panel("Queue wait P95 / P99", _quantiles(
            "kvgate_queue_wait_seconds", "pool", POOL, (0.95, 0.99)), unit="s"),
        Panel("TTFT P50 / P99, short (default) vs long pool", _quantiles(
            "kvgate_ttft_seconds", "pool", POOL, (0.5, 0.99)), unit="s"),
        Panel("Refusals by reason", (
            Target(f"sum by (reason) (rate(kvgate_refusals_total{{{POOL}}}[{RATE}]))",
                   "{{reason}}"),), unit="reqps"),
        Panel("Requests by outcome", (
            Target(f"sum by (outcome) (rate(kvgate_requests_total{{{POOL}}}[{RATE}]))",
                   "{{outcome}}"),), unit="reqps"),
        Panel("Reservation efficiency P50 (used ÷ reserved)", _quantiles(
            "kvgate_reservation_efficiency_ratio", "pool", POOL, (0.5,)), unit="percentunit"),
    ],
    "Tenants": [
        Panel("Tokens per second", (
            Target(f"sum by (tenant) (rate(kvgate_tenant_tokens_total"
                   f'{{{TENANT},kind=~"prompt|completion"}}[{RATE}]))', "{{tenant}}"),)),
        Panel("429s per second", (
            Target(f"sum by (tenant) (rate(kvgate_refusals_total"
                   f'{{{TENANT},reason=~"{TOO_MANY_REQUESTS}"}}[{RATE}]))', "{{tenant}}"),),
              unit="reqps"),
        Panel("Remaining token budget (this minute)", (
            Target(f"min by (tenant) (kvgate_tenant_remaining_tokens{{{TENANT}}})",
                   "{{tenant}}"),)),
    ],
    "State store and tokenizer": [
        Panel("Store up", (
            Target("min by (backend) (kvgate_state_store_up)", "{{backend}}"),)),
        Panel("Store errors and fail-open calls per second", (
            Target(f"sum by (backend) (rate(kvgate_state_store_errors_total[{RATE}]))",
                   "errors {{backend}}"),
            Target(f"sum by (backend) (rate(kvgate_state_store_fallback_calls_total[{RATE}]))",
                   "fail-open calls {{backend}}"),)),
        Panel("Store round trip", (
            Target("max by (backend) (kvgate_state_store_latency_seconds)", "{{backend}}"),),
              unit="s"),
        Panel("Tokenizer calibration (vLLM ÷ kvgate count)", (
            Target("avg by (model) (kvgate_tokenizer_calibration_ratio)", "{{model}}"),)),
    ],
}


def _variable(name: str, query: str, label: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
        "refresh": 2, "multi": True, "includeAll": True, "sort": 1,
        "current": {"text": "All", "value": "$__all"},
    }


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": panel_id, "type": panel.kind, "title": panel.title, "datasource": DATASOURCE,
        "description": panel.description,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": panel.unit, "custom": {"lineWidth": 2, "fillOpacity": 0}},
            "overrides": [
                {"matcher": {"id": "byName", "options": legend},
                 "properties": [{"id": key, "value": value} for key, value in props.items()]}
                for legend, props in panel.overrides.items()
            ],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr,
             "legendFormat": t.legend}
            for i, t in enumerate(panel.targets)
        ],
    }
    if panel.repeat:
        out.update(repeat=panel.repeat, repeatDirection="h", maxPerRow=2)
    return out


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, next_id = 0, 1
    for title, row in ROWS.items():
        panels.append({"id": next_id, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y, x = next_id + 1, y + 1, 0
        for panel in row:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(panel, next_id, x, y))
            next_id, x = next_id + 1, x + panel.width
        y += 8
    return {
        "uid": UID, "title": "kvgate fleet", "tags": ["kvgate", "vllm"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "timezone": "",
        "time": {"from": "now-1h", "to": "now"},
        "description": "kvgate in front of vLLM: the three KV views per replica, headroom, "
        "queues, latency by pool, tenants and the state store. Generated by kvgate/tools/dashboard.py.",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}, "refresh": 1},
            _variable("pool", "label_values(kvgate_replica_capacity_blocks, pool)", "Pool"),
            _variable("replica",
                      'label_values(kvgate_replica_capacity_blocks{pool=~"$pool"}, replica)',
                      "Replica"),
            _variable("tenant", "label_values(kvgate_tenant_tokens_total, tenant)", "Tenant"),
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
