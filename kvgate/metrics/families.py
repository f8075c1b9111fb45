"""The metric kinds kvgate declares (`labels()` remembered per label values: the request path
calls it about twenty times per request) and the histogram buckets its metrics share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import prometheus_client

M = TypeVar("M")


def _remembered(
    metric: object, make: Callable[..., M], values: tuple[Any, ...], kwargs: dict[str, Any]
) -> M:
    """`labels()` remembered per label values. prometheus_client validates the values, takes
    a lock and builds a key on every call; the request path calls it about twenty times per
    request. `remove()` and `clear()` forget what was remembered, so a
    remembered child is always the one the registry exports."""
    if kwargs:
        return make(*values, **kwargs)
    remembered: dict[tuple[Any, ...], M] = metric.__dict__.setdefault("_remembered", {})
    child = remembered.get(values)
    if child is None:
        child = remembered[values] = make(*values)
    return child


class _Remembering:
    """`labels()` remembered (see `_remembered`), for each kind of metric below."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        return _remembered(self, super().labels, labelvalues, labelkwargs)  # type: ignore[misc]

    def remove(self, *labelvalues: Any) -> None:
        self.__dict__.pop("_remembered", None)
        super().remove(*labelvalues)  # type: ignore[misc]

    def clear(self) -> None:
        self.__dict__.pop("_remembered", None)
        super().clear()  # type: ignore[misc]


class Counter(_Remembering, prometheus_client.Counter):
    pass


class Gauge(_Remembering, prometheus_client.Gauge):
    pass


class Histogram(_Remembering, prometheus_client.Histogram):
    pass


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# signed seconds: a wait that came later (+) or sooner (-) than estimated
ERROR_BUCKETS = (-10, -5, -2, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2, 5, 10)
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
