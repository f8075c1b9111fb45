"""Bounded load (Mirrokni, Thorup and Zadimoghaddam, 2018): an affinity — a session's replica,
a prefix's replica — is honoured only while that replica would hold at most
(1 + load_factor) × its capacity-weighted fair share of the reserved blocks among the
candidates, this request's included — or, below `floor` of its admissible blocks, whatever the
others hold: a lightly loaded fleet keeps every affinity (a strict share of a handful of
requests would scatter sessions for nothing), a loaded one spreads them. This is what keeps
affinity from pinning traffic to a saturated replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from kvgate.config import RoutingConfig
from kvgate.fleet.snapshot import ReplicaView
from kvgate.routing.plugin import PluginParams


def within_bound(
    view: ReplicaView,
    candidates: Sequence[ReplicaView],
    blocks: int,
    load_factor: float,
    floor: float = 0.0,
) -> bool:
    capacity = sum(v.admissible_blocks or 0 for v in candidates)
    if not capacity or not view.admissible_blocks:
        return False
    total = sum(v.reserved_blocks for v in candidates if v.admissible_blocks) + blocks
    fair = total * view.admissible_blocks / capacity
    after = view.reserved_blocks + blocks
    return after <= max((1 + load_factor) * fair, floor * view.admissible_blocks, blocks)


class BoundedLoad(PluginParams):
    """The parameters of an affinity under bounded load (defaults: `routing.load_factor`,
    `routing.load_floor`)."""

    load_factor: float = Field(0.25, ge=0)
    load_floor: float = Field(0.1, ge=0, le=1)

    @staticmethod
    def defaults(config: RoutingConfig) -> dict[str, Any]:
        return {"load_factor": config.load_factor, "load_floor": config.load_floor}
