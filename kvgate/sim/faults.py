"""Scripted faults a simulated replica can inject, set at start-up or at run time.

Each fault is a plain value; the decisions that involve chance (which requests fail, which
streams drop) draw from the replica's seeded RNG, so a run is reproducible.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Faults:
    """The active faults of one replica.

    latency_s: seconds to wait before handling each /v1 request.
    error_rate: fraction (0..1) of /v1 requests answered with a 500.
    drop_after_chunks: drop the connection after this many SSE chunks (0: before any); a
        non-streamed request affected by it gets its connection closed without an answer.
    drop_rate: fraction (0..1) of requests the drop applies to (with drop_after_chunks set).
    hang: accept /v1 requests and never answer them until the fault is cleared.
    health_fail: `/health` answers 503.
    stopped: the listener is closed; connections are refused; engine state is lost.
    """

    latency_s: float = 0.0
    error_rate: float = 0.0
    drop_after_chunks: int | None = None
    drop_rate: float = 1.0
    hang: bool = False
    health_fail: bool = False
    stopped: bool = False

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError("latency_s: must be >= 0")
        for name in ("error_rate", "drop_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be within [0, 1], got {value}")
        if self.drop_after_chunks is not None and self.drop_after_chunks < 0:
            raise ValueError("drop_after_chunks: must be >= 0")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Faults:
        """Build from JSON/YAML; unknown keys and wrong types are errors naming the key."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key not in fields:
                raise ValueError(f"{key}: unknown fault (known: {', '.join(fields)})")
            values[key] = _coerce(key, value)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def draw_error(self, rng: random.Random) -> bool:
        return self.error_rate > 0 and rng.random() < self.error_rate

    def draw_drop(self, rng: random.Random) -> int | None:
        """The chunk count after which this request's connection drops, or None."""
        if self.drop_after_chunks is None:
            return None
        if self.drop_rate < 1.0 and rng.random() >= self.drop_rate:
            return None
        return self.drop_after_chunks


_BOOLS = {"hang", "health_fail", "stopped"}
_FLOATS = {"latency_s", "error_rate", "drop_rate"}


def _coerce(key: str, value: Any) -> Any:
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: must be true or false, got {value!r}")
        return value
    if key in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key}: must be a number, got {value!r}")
        return float(value)
    # drop_after_chunks
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: must be an integer or null, got {value!r}")
    return value
