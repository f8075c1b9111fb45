"""What a PromQL expression refers to, and what kvgate and vLLM export, so that tests can check
that the dashboard and the alert rules name only series that exist.

Not a PromQL parser: a tokenizer that knows which identifiers are functions, keywords and
aggregations, which are label names (in `{...}` matchers and `by/on/without/ignoring/group_*`
lists), and which are metric names (the rest).
"""

from __future__ import annotations

import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.metrics import Metrics
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.metrics import SimMetrics

# Series other work is adding, written against their agreed names (see the merge notes).
PENDING: dict[str, set[str]] = {}
# Labels Prometheus itself attaches to every scraped series.
TARGET_LABELS = {"instance", "job"}

KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk",
    "bottomk", "quantile", "count_values", "group", "inf", "nan",
}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "days_in_month", "delta", "deriv", "exp", "floor",
    "histogram_quantile", "holt_winters", "hour", "idelta", "increase", "irate",
    "label_join", "label_replace", "ln", "log2", "log10", "minute", "month",
    "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt",
    "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time", "max_over_time",
    "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time",
    "last_over_time", "present_over_time",
}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")


def references(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression refers to."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals name nothing
    text = re.sub(r"\$\{?\w+\}?", "1", text)  # Grafana variables
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries: [5m], [1h:1m]
    labels: set[str] = set()
    for match in _LABEL_LIST.finditer(text):
        labels |= {name.strip() for name in match.group(1).split(",") if name.strip()}
    text = _LABEL_LIST.sub(" ", text)
    for match in _MATCHERS.finditer(text):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", match.group(1)))
    text = _MATCHERS.sub(" ", text)
    text = re.sub(r"\b\d[\w.]*", " ", text)  # numbers and durations
    names = {
        word for word in _IDENT.findall(text)
        if word.lower() not in KEYWORDS and word not in FUNCTIONS
    }
    return names, labels


def exported() -> dict[str, set[str]]:
    """Every series name kvgate or a vLLM replica (the simulator) exports, with its labels."""
    out: dict[str, set[str]] = {}
    for value in vars(Metrics()).values():
        if not hasattr(value, "_labelnames"):
            continue
        labels = set(value._labelnames)
        if value._type == "counter":
            out[value._name + "_total"] = labels
        elif value._type == "histogram":
            out[value._name + "_bucket"] = labels | {"le"}
            out[value._name + "_sum"] = out[value._name + "_count"] = labels
        else:
            out[value._name] = labels
    config = SimConfig()
    sim = SimMetrics(config, Engine(config))
    for family in text_string_to_metric_families(generate_latest(sim.registry).decode()):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out.setdefault(sample.name, set()).update(sample.labels)
    for name, labels in PENDING.items():
        out.setdefault(name, set()).update(labels)
    return out


def unknown(expr: str, series: dict[str, set[str]]) -> list[str]:
    """What in `expr` names a series or a label that no named series has."""
    names, labels = references(expr)
    problems = [f"no such metric: {name}" for name in sorted(names - series.keys())]
    known = set(TARGET_LABELS).union(*(series.get(name, set()) for name in names))
    problems += [f"no such label: {label}" for label in sorted(labels - known)]
    return problems
