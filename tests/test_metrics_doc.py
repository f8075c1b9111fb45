"""docs/metrics.md is the catalogue of kvgate's metrics; it must match kvgate/metrics/."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvgate.metrics import Metrics

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def documented() -> dict[str, tuple[str, set[str]]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"\| `(kvgate_[a-z_]+)` \| (\w+) \| ([^|]*) \|", line)
        if match:
            labels = {label.strip() for label in match.group(3).split(",") if label.strip()}
            rows[match.group(1)] = (match.group(2), labels)
    return rows


def declared() -> dict[str, tuple[str, set[str]]]:
    metrics = Metrics()
    out = {}
    for value in vars(metrics).values():
        if hasattr(value, "_labelnames"):
            name = value._name + ("_total" if value._type == "counter" else "")
            out[name] = (value._type, set(value._labelnames))
    return out


def test_every_declared_metric_is_documented_with_its_type_and_labels():
    assert declared() == documented()


def test_the_metrics_endpoint_renders_in_prometheus_text_format():
    metrics = Metrics()
    metrics.requests.labels("m", "default", "t", "ok").inc()
    families = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    assert "kvgate_requests" in families
    assert all(name.startswith("kvgate_") for name in families)
