"""What the router answers for one request: the replicas best first, and for how long only
one of them may take it.

Admission reads a ranking through `usable(waited_s)` alone: which replicas a request that has
waited so long may be placed on now. Why a replica is held for a while (a session's cache is
there, say) is the business of the routing plugin that asked for the hold, never admission's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgate.fleet.snapshot import Fleet, ReplicaView


@dataclass(frozen=True, slots=True)
class Hold:
    """A picker rule: only `replica` may take the request until it has waited `for_s` seconds,
    unless that replica is busy (vLLM's queue limits refused it lately), which ends the hold
    at once."""

    replica: ReplicaView
    for_s: float


@dataclass(frozen=True, slots=True)
class Ranking:
    replicas: list[ReplicaView]  # best first
    hold: Hold | None = None  # a picker rule on the first replicas to try, if a plugin set one
    # plugin name -> the one replica its scorer scored 1 (a session's, a prefix's), if one did
    favourites: Mapping[str, str] = field(default_factory=dict)
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
