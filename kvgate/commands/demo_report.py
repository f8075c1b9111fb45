"""`kvgate demo --workload`'s report: each column's figures (the workload's summary, goodput,
refusals at arrival, the replicas' own counters) and the table that lays them side by side."""

from __future__ import annotations

from typing import Any, Protocol

from kvgate.tools.workload import goodput, summarize

# Latency targets for goodput, in simulated seconds (× --time-scale on the wall clock).
SHORT_TTFT_SLO_S, LONG_TTFT_SLO_S = 2.0, 10.0
# kvgate's latency targets (admission.queue.ttft_target_s) for the interactive classes, the
# chats' (vip is critical, chat-app standard): what could not start within the goodput target
# is refused at arrival rather than served late. The batch class (sheddable) has none: it waits.
TTFT_TARGETS_S = {"critical": SHORT_TTFT_SLO_S, "standard": SHORT_TTFT_SLO_S}
# The columns of `--workload`: no admission, then kvgate in each admission mode; and kvgate
# predicted without prompt normalization, to show what it does to prefix-cache hits.
COLUMNS = {"no_admission": "no admission", "worst_case": "kvgate worst",
           "predicted_raw": "predicted no norm", "predicted": "kvgate predicted"}  # fmt: skip


class Fleet(Protocol):
    async def stats(self) -> dict[str, dict[str, Any]]: ...


def short_ttfts(results: list[Any], time_scale: float) -> list[float | None]:
    """Short requests' TTFTs in simulated seconds; None for those that never got a token."""
    scale = time_scale or 1.0
    return [None if r.ttft_s is None else r.ttft_s / scale for r in results if r.kind != "long"]


async def column(results: list[Any], fleet: Fleet, duration_s: float, time_scale: float,
                 tenants: list[str]) -> dict[str, Any]:  # fmt: skip
    """One column of the report: the summary, goodput, the refusals at arrival of each of
    `tenants`, and the replicas' own counters."""
    scale = time_scale or 1.0
    replicas = await fleet.stats()
    hits = sum(r["prefix_cache_hits"] for r in replicas.values())
    queries = sum(r["prefix_cache_queries"] for r in replicas.values())
    return {
        **summarize(results).as_dict(),
        "goodput_per_s": round(goodput(results, duration_s / scale,
                                       short_ttft_s=SHORT_TTFT_SLO_S * scale,
                                       long_ttft_s=LONG_TTFT_SLO_S * scale), 3),
        "preemptions": sum(r["preemptions"] for r in replicas.values()),
        "prefix_hit_rate": round(hits / queries, 3) if queries else None,
        "replicas": replicas,
        "refused_at_arrival": refused_at_arrival(results, tenants),
    }


def refused_at_arrival(results: list[Any], tenants: list[str]) -> dict[str, int]:
    """Per tenant, the requests kvgate refused at once because they would have missed their
    class's latency target (429 wait_budget_exceeded)."""
    return {t: sum(r.tenant == t and r.error_code == "wait_budget_exceeded" for r in results)
            for t in tenants}


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    rows = [f"workload: {w['requests']} requests ({w['long']} long documents) over "
            f"{w['duration_s']:g}s, {w['rate_per_s']:g}/s", ""]
    shown = [key for key in COLUMNS if key in report]
    columns = [report[key] for key in shown]
    rows.append(f"{'':34}" + "".join(f"{COLUMNS[key]:>18}" for key in shown))

    def row(label: str, *path: str, default: Any = None) -> None:
        """One figure per column, found in each column's report along `path`."""
        values = [_dig(c, path, default) for c in columns]
        rows.append(f"{label:34}" + "".join(f"{_fmt(v):>18}" for v in values))

    row("completed", "completed")
    row("failed (5xx, dropped)", "failed")
    for reason in sorted(set().union(*(c["refused"] for c in columns))):
        row(f"refused {reason}", "refused", reason, default=0)
    for tenant in columns[0].get("refused_at_arrival", {}):
        row(f"refused at arrival: {tenant}", "refused_at_arrival", tenant, default=0)
    simulated = w.get("fleet", "simulator") == "simulator"
    unit = "simulated" if simulated else "wall"
    row(f"goodput (req/s, {unit})", "goodput_per_s")
    for kind in ("short", "long"):
        for q in ("p50", "p99"):
            row(f"TTFT {kind} {q} (s)", "ttft_s", kind, q)
        for q in ("p50", "p99"):
            row(f"end to end {kind} {q} (s)", "e2e_s", kind, q)
    for tenant in ("vip", "chat-app", "batch"):  # vip is critical, batch sheddable
        row(f"TTFT {tenant} p50 (s)", "ttft_s", f"tenant {tenant}", "p50")
    row("preemptions (fleet)", "preemptions")
    row("prefix hit rate (fleet)", "prefix_hit_rate")
    for name in columns[0]["replicas"]:
        row(f"{name} preemptions", "replicas", name, "preemptions")
        row(f"{name} prefix hit rate", "replicas", name, "prefix_hit_rate")
    rows += ["", f"goodput: requests per {unit} second whose first token came within "
             f"{SHORT_TTFT_SLO_S:g} s (short) or {LONG_TTFT_SLO_S:g} s (long) {unit} "
             f"(x {w['time_scale']:g} on the wall clock); latencies above are wall seconds.",
             "refused at arrival: chats whose class has a latency target in kvgate "
             f"({', '.join(f'{c} {s:g} s' for c, s in TTFT_TARGETS_S.items())} {unit};",
             "vip is critical, chat-app standard) that kvgate expected to start later: 429 "
             "wait_budget_exceeded at once, with Retry-After. batch (sheddable) has no target:",
             "it waits for room (up to max_wait_s), as it would on vLLM."]
    return "\n".join(rows)


def _dig(report: dict[str, Any], path: tuple[str, ...], default: Any) -> Any:
    value: Any = report
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
