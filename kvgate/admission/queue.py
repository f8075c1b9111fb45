"""The fair queue of requests waiting for KV capacity. Pure: no I/O, no clock, no asyncio.

Service order: priority class first (critical, then standard, then sheddable); within a class,
round robin across tenants, so one tenant's burst cannot starve the others; FIFO within a
tenant. The depth is bounded by the caller at each push (the bound in force then: a lower one
after a reload sheds nobody already queued, it refuses newcomers until the queue drains below
it): when full, a newcomer of a better class sheds the newest ticket of the worst class present
(taken from the tenant with the most queued, the one bursting); otherwise the newcomer itself
is refused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvgate.config import PRIORITY_CLASSES


@dataclass(eq=False, slots=True)
class Ticket:
    tenant: str
    priority: str  # one of PRIORITY_CLASSES
    enqueued_at: float
    payload: Any = None
    # in the queue now: a ticket already served or shed is not looked for (a miss would cost
    # a scan of its tenant's lane, and the ValueError a repr of the ticket and its payload)
    queued: bool = field(default=False, repr=False)

    @property
    def rank(self) -> int:
        return PRIORITY_CLASSES.index(self.priority)


@dataclass(slots=True)
class _Class:
    # tenant -> its tickets, FIFO; dict order is the round-robin order
    tenants: OrderedDict[str, deque[Ticket]] = field(default_factory=OrderedDict)
    size: int = 0


class FairQueue:
    def __init__(self) -> None:
        self._classes = [_Class() for _ in PRIORITY_CLASSES]
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def depth(self, priority: str) -> int:
        return self._classes[PRIORITY_CLASSES.index(priority)].size

    def push(self, ticket: Ticket, max_depth: int) -> Ticket | None:
        """Queue `ticket` if fewer than `max_depth` (at least 1) are queued. Returns the ticket
        refused to keep the bound: None when there was room, a shed ticket of a worse class, or
        `ticket` itself (then it was not queued)."""
        if max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        shed = None
        if self._size >= max_depth:
            worst = max(i for i, c in enumerate(self._classes) if c.size)
            if worst <= ticket.rank:
                return ticket
            shed = self._shed_from(worst)
        cls = self._classes[ticket.rank]
        cls.tenants.setdefault(ticket.tenant, deque()).append(ticket)
        ticket.queued = True
        cls.size += 1
        self._size += 1
        return shed

    def serve(self, ticket: Ticket) -> bool:
        """Remove a ticket because it was served: its tenant goes to the back of the round."""
        if not self.remove(ticket):
            return False
        cls = self._classes[ticket.rank]
        if ticket.tenant in cls.tenants:
            cls.tenants.move_to_end(ticket.tenant)
        return True

    def remove(self, ticket: Ticket) -> bool:
        """Remove a ticket that leaves without being served (timeout, disconnect)."""
        if not ticket.queued:
            return False
        cls = self._classes[ticket.rank]
        tickets = cls.tenants[ticket.tenant]
        tickets.remove(ticket)
        ticket.queued = False
        if not tickets:
            del cls.tenants[ticket.tenant]
        cls.size -= 1
        self._size -= 1
        return True

    def peek(self) -> Ticket | None:
        for cls in self._classes:
            if cls.size:
                return next(iter(cls.tenants.values()))[0]
        return None

    def pop(self) -> Ticket:
        """Take the next ticket in service order and move its tenant to the back of the round."""
        for cls in self._classes:
            if not cls.size:
                continue
            tenant, tickets = next(iter(cls.tenants.items()))
            ticket = tickets.popleft()
            ticket.queued = False
            if tickets:
                cls.tenants.move_to_end(tenant)
            else:
                del cls.tenants[tenant]
            cls.size -= 1
            self._size -= 1
            return ticket
        raise IndexError("pop from an empty FairQueue")

    def __iter__(self) -> Iterator[Ticket]:
        """Every ticket in the order `pop` would serve them, without changing anything."""
        for cls in self._classes:
            lanes = [list(tickets) for tickets in cls.tenants.values()]
            depth = max((len(lane) for lane in lanes), default=0)
            for i in range(depth):
                for lane in lanes:
                    if i < len(lane):
                        yield lane[i]

    def position(self, ticket: Ticket) -> int:
        """How many tickets would be served before this one (its index in service order)."""
        for i, queued in enumerate(self):
            if queued is ticket:
                return i
        raise ValueError("ticket is not queued")

    def _shed_from(self, rank: int) -> Ticket:
        cls = self._classes[rank]
        # the tenant with the most queued; among equals, the one whose last ticket is newest
        tenant = max(cls.tenants, key=lambda t: (len(cls.tenants[t]), cls.tenants[t][-1].enqueued_at))
        ticket = cls.tenants[tenant].pop()
        ticket.queued = False
        if not cls.tenants[tenant]:
            del cls.tenants[tenant]
        cls.size -= 1
        self._size -= 1
        return ticket
