"""One child of a prometheus_client metric, read through its public `collect()`:

    assert sample_value(metrics.session_routes, "new", "unbound") == 1

rather than through the child's private `_value`.
"""

from __future__ import annotations

from prometheus_client.metrics import MetricWrapperBase


def sample_value(metric: MetricWrapperBase, *labels: str) -> float:
    """The value of `metric`'s child with these label values, in the order the metric names
    them: a counter's total, a gauge's value. Like `labels()`, it makes the child (at 0) if
    there is none yet."""
    (family,) = metric.labels(*labels).collect()
    return next(s.value for s in family.samples if s.name in (family.name, f"{family.name}_total"))
