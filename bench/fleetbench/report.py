"""Medians over repeats, the table on stdout, the markdown summary and the plots.

`medians` takes every run's record and gives one per workload × load × contender, each
number the median over its repeats (a refusal or failure reason missing from a repeat counts
as 0 there). The markdown is written to be included verbatim in docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .contenders import CONTENDERS
from .metrics import LONG_TTFT_SLO_S, SHORT_TTFT_SLOS_S

ROOT = Path(__file__).resolve().parents[2]
KEY = ("workload", "load", "contender")
# A workload without output_len_* settings sets each answer's length itself.
PER_REQUEST = ("each request's own, set by the workload (the simulator's benchmark-only "
               "X-Sim-Output-Tokens header, which the contenders pass on unread)")


def row_order(row: dict[str, Any]) -> tuple[float, int]:
    """Rows by load, then contenders as CONTENDERS lists them (baseline first)."""
    names = list(CONTENDERS)
    name = row["contender"].removesuffix("@base")  # the code before, beside the code after
    rank = names.index(name) if name in names else len(names)
    return row["load"], 2 * rank + row["contender"].endswith("@base")


def medians(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for record in runs:
        groups.setdefault(tuple(record[k] for k in KEY), []).append(record)
    out = []
    for key, records in groups.items():
        measured = [r for r in records if "error" not in r]
        row: dict[str, Any] = dict(zip(KEY, key, strict=True))
        row["repeats"] = len(measured)
        if not measured:
            row["error"] = records[0]["error"]
        else:
            row.update(_median_tree([{k: v for k, v in r.items() if k not in (*KEY, "samples")}
                                     for r in measured]))  # fmt: skip
        out.append(row)
    return out


def _median_tree(trees: list[Any]) -> Any:
    first = next((t for t in trees if t is not None), None)
    if isinstance(first, dict):
        keys = sorted({k for t in trees if isinstance(t, dict) for k in t}, key=str)
        # A reason counted in one repeat and absent from another was 0 there.
        zero = 0 if all(isinstance(v, int | float) for t in trees for v in t.values()) else None
        return {k: _median_tree([t.get(k, zero) if isinstance(t, dict) else None
                                 for t in trees]) for k in keys}  # fmt: skip
    numbers = [t for t in trees if isinstance(t, int | float) and not isinstance(t, bool)]
    if numbers and len(numbers) == len([t for t in trees if t is not None]):
        value = statistics.median(numbers)
        return round(value, 3) if isinstance(value, float) else value
    return first


COLUMNS: list[tuple[str, tuple[str, ...], str]] = [
    ("goodput@1s", ("goodput_per_s", "short_ttft_1s"), "{:.2f}"),
    ("goodput@2s", ("goodput_per_s", "short_ttft_2s"), "{:.2f}"),
    ("done", ("completed",), "{}"),
    ("refused", ("refused",), "{}"),
    ("failed", ("failed",), "{}"),
    ("TTFT short p50/p99", ("ttft_s", "short"), "pair"),
    ("TTFT long p50/p99", ("ttft_s", "long"), "pair"),
    ("TTFT crit p50/p99", ("ttft_s", "critical"), "pair"),
    ("crit floor p99", ("critical_floor", "floor_s", "p99"), "{:.2f}"),
    ("crit over floor p99", ("critical_floor", "over_floor_s", "p99"), "{:.2f}"),
    ("crit queued", ("critical_queued",), "queued"),
    ("e2e short p50/p99", ("e2e_s", "short"), "pair"),
    ("out tok/s", ("output_tokens_per_s",), "{:.0f}"),
    ("preempt", ("preemptions",), "{}"),
    ("hit rate", ("prefix_cache_hit_rate",), "{:.2f}"),
    ("sim speed", ("run", "sim_speed_min"), "{:.2f}"),
]


def cell(row: dict[str, Any], path: tuple[str, ...], fmt: str) -> str:
    if "error" in row:
        return "—"
    value: Any = row
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        return "—"
    if fmt == "queued":
        return f"{value['queued']} ({value['over']} > {value['over_s']:g} s)"
    if fmt == "pair":
        return "/".join("—" if value.get(q) is None else f"{value[q]:.2f}" for q in ("p50", "p99"))
    if isinstance(value, dict):  # reasons: the total, then each
        total = sum(value.values())
        return f"{total:g}" if total == 0 else f"{total:g} (" + ", ".join(
            f"{reason}: {n:g}" for reason, n in value.items() if n) + ")"
    return fmt.format(value)


def table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """One table per workload, rows by load then contender."""
    lines: list[str] = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = sorted((r for r in rows if r["workload"] == workload), key=row_order)
        header = ["load", "contender", *(name for name, _, _ in COLUMNS)]
        body = [[f"{r['load']:g}x", r["contender"], *(cell(r, p, f) for _, p, f in COLUMNS)]
                for r in mine]  # fmt: skip
        errors = [f"{r['contender']} at {r['load']:g}x: {r['error'].splitlines()[0]}"
                  for r in mine if "error" in r]  # fmt: skip
        if markdown:
            lines += [f"**{workload}**", "", "| " + " | ".join(header) + " |",
                      "|" + "---|" * len(header)]  # fmt: skip
            lines += ["| " + " | ".join(b) + " |" for b in body]
        else:
            widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
            lines += [f"== {workload}", "  ".join(h.rjust(w) for h, w in zip(header, widths,
                                                                             strict=True))]
            lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
        lines += [*(f"not measured: {e}" for e in errors), ""]
    return "\n".join(lines)


def legend() -> str:
    slos = " and ".join(f"{s:g} s" for s in SHORT_TTFT_SLOS_S)
    return (
        f"goodput@Ns: requests per simulated second of the workload that completed with their "
        f"first token within N s (short; {slos} reported) or {LONG_TTFT_SLO_S:g} s (long). "
        "Counts and latencies are of the requests sent after the warm-up. "
        "done/refused/failed: request counts (refused = 4xx by status and code; failed = 5xx, "
        "dropped, error mid-stream or timeout). Latencies: simulated seconds, completed "
        "requests; crit = the critical tenant. crit floor: the TTFT an idle replica with an "
        "empty cache gives each completed critical request (its chunked prefill alone, on the "
        "same engine; a cached system prompt makes the true floor lower by up to 0.03 s); "
        "crit over floor: each one's TTFT less its floor, the part waiting added. crit queued: "
        "critical requests that waited in kvgate's queue at all (warm-up included), and how "
        "many waited there longer than the largest bucket of its histogram within 0.5 s. "
        "out tok/s: completed requests' output tokens "
        "per simulated second of the workload. preempt, hit rate: the replicas' own counters "
        "(vllm:num_preemptions_total; vllm:prefix_cache_hits_total / queries), summed over the "
        "fleet, over the whole run (warm-up included). sim speed: the slowest replica's "
        "simulated seconds × time_scale per wall second (1.00 = kept pace)."
    )


def plots(rows: list[dict[str, Any]], runs: list[dict[str, Any]], out_dir: Path,
          stem: str) -> list[Path]:  # fmt: skip
    """Goodput against load per workload, and CDFs of short TTFT at 2x load; PNG paths
    (none without matplotlib, which only the `bench` extra installs)."""
    try:
        import matplotlib
    except ImportError:
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload and "error" not in r]
        fig, axes = plt.subplots(1, len(SHORT_TTFT_SLOS_S), figsize=(11, 4), sharey=True)
        for ax, slo in zip(axes, SHORT_TTFT_SLOS_S, strict=True):
            for contender in dict.fromkeys(r["contender"] for r in mine):
                points = sorted((r["load"], r["goodput_per_s"][f"short_ttft_{slo:g}s"])
                                for r in mine if r["contender"] == contender)  # fmt: skip
                ax.plot(*zip(*points, strict=True), marker="o", label=contender)
            ax.set_title(f"{workload}: short TTFT ≤ {slo:g} s, long ≤ {LONG_TTFT_SLO_S:g} s")
            ax.set_xlabel("offered load (× fleet capacity)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("goodput (requests / simulated s)")
        axes[-1].legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{stem}-goodput-{workload}.png"))
        plt.close(fig)

        samples: dict[str, tuple[list[float], int]] = {}
        for record in runs:
            if record["workload"] == workload and record["load"] == 2 and "samples" in record:
                values, total = samples.get(record["contender"], ([], 0))
                samples[record["contender"]] = (values + record["samples"]["short_ttft_s"],
                                                total + record["samples"]["short_requests"])
        if not samples:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for contender, (values, total) in samples.items():
            # Over every short request sent: refused and failed ones never reach the top.
            ordered = sorted(values)
            ax.step(ordered, [(i + 1) / total for i in range(len(ordered))],
                    where="post", label=f"{contender} ({len(ordered)}/{total} completed)")
        for slo in SHORT_TTFT_SLOS_S:
            ax.axvline(slo, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT of completed short requests (simulated s, log scale)")
        ax.set_ylabel("fraction of short requests sent")
        ax.set_title(f"{workload} at 2× load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{stem}-ttft-cdf-{workload}-2x.png"))
        plt.close(fig)
    return written


def _link(path: Path) -> str:
    """A plot's link in the markdown: its path from the repository's root (docs/benchmarks.md
    includes the markdown), or its name where it was written outside the repository."""
    try:
        return "/" + path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=90)
    return path


def ratios(rows: list[dict[str, Any]], baseline: str = "direct-rr") -> str:
    """Goodput (2 s) of each contender over the baseline's in the same run, as a table."""
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = sorted((r for r in rows if r["workload"] == workload and "error" not in r),
                      key=row_order)  # fmt: skip
        loads = sorted({r["load"] for r in mine})
        base = {r["load"]: r["goodput_per_s"]["short_ttft_2s"] for r in mine
                if r["contender"] == baseline}  # fmt: skip
        if not base:
            continue
        lines += [f"**{workload}**: goodput@2s over {baseline}'s", "",
                  "| contender | " + " | ".join(f"{x:g}x" for x in loads) + " |",
                  "|---|" + "---|" * len(loads)]  # fmt: skip
        for contender in dict.fromkeys(r["contender"] for r in mine):
            got = {r["load"]: r["goodput_per_s"]["short_ttft_2s"] for r in mine
                   if r["contender"] == contender}  # fmt: skip
            cells = [_ratio(got.get(x), base.get(x)) for x in loads]
            lines.append(f"| {contender} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None:
        return "—"
    if base == 0:
        return "—" if value == 0 else "∞ (baseline 0)"
    return f"{value / base:.2f}"


def best(rows: list[dict[str, Any]]) -> str:
    """Per workload and load, the contender with the highest goodput@2s (ties named)."""
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        parts = []
        mine = [r for r in rows if r["workload"] == workload and "error" not in r]
        for load in sorted({r["load"] for r in mine}):
            at = sorted((r for r in mine if r["load"] == load), key=row_order)
            top = max(r["goodput_per_s"]["short_ttft_2s"] for r in at)
            leaders = [r["contender"] for r in at if r["goodput_per_s"]["short_ttft_2s"] == top]
            named = leaders[0] if len(leaders) == 1 else f"{len(leaders)} tied"
            parts.append(f"{load:g}x {named} ({top:.2f}/s)")
        lines.append(f"- {workload}, highest goodput@2s: " + "; ".join(parts) + ".")
    return "\n".join(lines)


def tenants(rows: list[dict[str, Any]]) -> str:
    """Per workload at its highest load: each tenant's requests completed and its TTFT."""
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload and "by_tenant" in r]
        if not mine:
            continue
        load = max(r["load"] for r in mine)
        at = sorted((r for r in mine if r["load"] == load), key=row_order)
        names = sorted({t for r in at for t in r["by_tenant"]})
        lines += [f"**{workload} at {load:g}x, per tenant**: completed / sent, TTFT p50/p99 (s) "
                  "of the completed", "",
                  "| contender | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for r in at:
            cells = []
            for name in names:
                t = r["by_tenant"].get(name) or {}
                ttft = t.get("ttft_s") or {}
                cells.append(f"{t.get('completed', 0):g} / {t.get('requests', 0):g}, "
                             + "/".join("—" if ttft.get(q) is None else f"{ttft[q]:.2f}"
                                        for q in ("p50", "p99")))
            lines.append(f"| {r['contender']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def markdown(meta: dict[str, Any], estimates: dict[str, Any], rows: list[dict[str, Any]],
             plots: list[Path]) -> str:  # fmt: skip
    settings = meta["settings"]
    fleet_lines = [f"  - `{name}`: " + ", ".join(f"{k} {v}" for k, v in knobs.items())
                   for name, knobs in meta["fleet"].items()]  # fmt: skip
    capacity_lines = [
        f"  - {name}: **{e['requests_per_s']:.2f} requests per simulated second** (the "
        f"{e['bottleneck_pool']} pool saturates first; "
        + "; ".join(f"{p['pool']}: {p['saturated_requests_per_s_per_replica']:.2f} req/s "
                    f"per replica, {p['share']:.0%} of requests" for p in e["pools"]) + ")"
        for name, e in estimates.items()
    ]  # fmt: skip
    method = next(iter(estimates.values()))["method"] if estimates else ""
    return "\n".join([
        "# Fleet benchmark: kvgate's admission against a bare fleet and vllm-router",
        "",
        f"`{meta['command'].strip()}` — {meta['date']}, profile {meta['profile']}, "
        f"{meta['wall_s']:.0f} s of wall time; {meta['machine']['cpus']} shared cores "
        f"(load average before: {meta['machine']['load_before']}), "
        f"Python {meta['machine']['python']}.",
        "",
        best(rows),
        "",
        table(rows, markdown=True),
        legend(),
        "",
        ratios(rows),
        tenants(rows),
        "Tenants: `vip` is critical, `chat-app` standard, `batch` sheddable, with no tenant "
        "limits (the other contenders have none); kvgate-predicted admits every class on "
        "predicted demand, kvgate-worst every class on its worst case.",
        "",
        *(f"![{p.stem}]({_link(p)})" for p in plots),
        "",
        "## How it was measured",
        "",
        "- Workloads: " + "; ".join(f"`{n}` — {d}" for n, d in meta.get("workloads", {}).items()
                                    if d) + ".",
        f"- Runs: loads {', '.join(f'{x:g}x' for x in settings['loads'])} of capacity; per "
        "workload, simulated seconds of open-loop arrivals (Poisson, or a trace's own times "
        "compressed to the load) sent to fill the fleet "
        "(warm-up, not counted), then seconds whose requests are counted, and the replicas' "
        "time_scale (wall seconds per simulated second): "
        + "; ".join(f"{n} {s['warmup_s']:g} s + {s['duration_s']:g} s at time_scale "
                    f"{s['time_scale']:g}" for n, s in settings["per_workload"].items())
        + f". A request is cancelled (failed: timeout) without its first token "
        f"{settings['ttft_timeout_s']:g} s after it was sent, or unfinished after "
        f"{settings['timeout_s']:g} s. {settings['repeats']} repeat(s), medians reported, "
        "contender order alternating. Every run starts a fresh fleet (no cache or queue "
        "inherited) and the contender's own processes; the load generator is this process.",
        "- Time: latencies are the load generator's wall clock ÷ time_scale, and kvgate's "
        "durations (discovery interval, latency targets, queue wait) are given in simulated seconds × "
        "time_scale. The replicas' own clocks ran at the \"sim speed\" of the table: below 1 "
        "they fell behind the wall clock (CPU contention, step timers overshooting), and "
        "latencies are overstated by up to 1/sim speed.",
        "- Fleet: three normal replicas and one long-context replica, each a `kvgate sim` "
        "process (times in simulated seconds):",
        *fleet_lines,
        "- Output lengths: " + "; ".join(f"{n}: " + (", ".join(f"{k} {v}" for k, v in o.items())
                                                     or PER_REQUEST)
                                         for n, o in meta["output_lengths"].items()) + ".",
        "- Contenders: " + "; ".join(f"`{n}` — {d}" for n, d in meta["contenders"].items())
        + ".",
        "- Capacity (1x load), estimated once per workload: " + method,
        *capacity_lines,
        "",
    ])  # fmt: skip
