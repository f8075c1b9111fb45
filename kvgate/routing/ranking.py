"""What the router answers for one request: the replicas best first, and for how long only
one of them may take it.

Admission reads a ranking through `usable(waited_s)` alone: which replicas a request that has
waited so long may be placed on now. Why a replica is held for a while (a session's cache is
there, say) is the business of the routing plugin that asked for the hold, never admission's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgate.fleet.snapshot import Fleet, ReplicaView
from kvgate.routing.route import Route

if TYPE_CHECKING:
    from kvgate.fleet.kv_events import KvEvents


@dataclass(frozen=True, slots=True)
class Hold:
    """A picker rule: only `replica` may take the request until it has waited `for_s` seconds,
    unless that replica is busy (vLLM's queue limits refused it lately), which ends the hold
    at once."""

    replica: ReplicaView
    for_s: float


@dataclass(slots=True)
class Cycle:
    """One ranking's shared state (the Inference Extension's CycleState): what the router and
    its plugins learned of the request against one fleet snapshot, read by the hooks after
    them and by the request's `served`. The router makes one per ranking."""

    # plugin name -> the one replica its scorer scored 1 (a session's, a prefix's), if one did
    favourites: dict[str, str] = field(default_factory=dict)
    # replica -> how many of the prompt's leading blocks its KV events say it holds (None: no
    # index of it is trusted), asked once per ranking whichever plugin asks first
    cached: dict[str, int | None] = field(default_factory=dict)

    def cached_blocks(self, events: KvEvents, route: Route, view: ReplicaView) -> int | None:
        if view.id not in self.cached:
            prompt = route.prompt_keys(view.block_size)
            self.cached[view.id] = None if prompt is None else events.cached_blocks(view.id, prompt)
        return self.cached[view.id]


@dataclass(frozen=True, slots=True)
class Ranking:
    replicas: list[ReplicaView]  # best first
    hold: Hold | None = None  # a picker rule on the first replicas to try, if a plugin set one
    cycle: Cycle = field(default_factory=Cycle)  # what its plugins learned while ranking
    fleet: Fleet | None = None  # the snapshot it was ranked against

    def usable(self, waited_s: float) -> list[ReplicaView]:
        """The replicas a request that has waited `waited_s` may be placed on now: the held
        replica alone while its hold lasts, then all of them in order; never one that is busy
        (vLLM's queue limits refused it lately)."""
        hold = self.hold
        if hold is not None and waited_s < hold.for_s and not hold.replica.busy:
            return [hold.replica]
        if not any(view.busy for view in self.replicas):
            return self.replicas
        return [view for view in self.replicas if not view.busy]
