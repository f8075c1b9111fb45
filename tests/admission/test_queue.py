"""The fair queue: priority first, round robin across tenants, FIFO within a tenant, bounded."""

from __future__ import annotations

import pytest

from kvgate.admission.queue import FairQueue, Ticket
from kvgate.admission.waiting import RecentSizes

DEEP = 100  # room for every ticket a test pushes


def ticket(tenant: str, priority: str = "standard", n: int = 0) -> Ticket:
    return Ticket(tenant, priority, float(n), payload=f"{tenant}{n}")


def drain(queue: FairQueue) -> list[str]:
    return [queue.pop().payload for _ in range(len(queue))]


def test_a_burst_from_one_tenant_does_not_starve_another():
    queue = FairQueue()
    for i in range(5):
        queue.push(ticket("a", n=i), DEEP)
    queue.push(ticket("b", n=0), DEEP)
    queue.push(ticket("b", n=1), DEEP)
    assert drain(queue) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]


def test_iteration_shows_the_order_pop_serves():
    queue = FairQueue()
    for t in [ticket("a", n=0), ticket("a", n=1), ticket("b", n=0), ticket("c", n=0)]:
        queue.push(t, DEEP)
    assert [t.payload for t in queue] == ["a0", "b0", "c0", "a1"]
    assert drain(queue) == ["a0", "b0", "c0", "a1"]


def test_higher_priority_class_is_served_first():
    queue = FairQueue()
    queue.push(ticket("a", "sheddable", 0), DEEP)
    queue.push(ticket("b", "standard", 0), DEEP)
    queue.push(ticket("c", "critical", 0), DEEP)
    assert drain(queue) == ["c0", "b0", "a0"]


def test_full_queue_sheds_the_newest_of_the_worst_class_from_the_biggest_tenant():
    queue = FairQueue()
    queue.push(ticket("x", "sheddable", 0), 3)
    queue.push(ticket("y", "sheddable", 0), 3)
    queue.push(ticket("y", "sheddable", 1), 3)
    newcomer = ticket("z", "standard", 0)
    shed = queue.push(newcomer, 3)
    assert shed is not None and shed.payload == "y1"
    assert len(queue) == 3
    assert drain(queue) == ["z0", "x0", "y0"]


def test_full_queue_refuses_a_newcomer_no_better_than_the_worst_present():
    queue = FairQueue()
    queue.push(ticket("x", "standard", 0), 2)
    queue.push(ticket("y", "standard", 0), 2)
    newcomer = ticket("z", "standard", 0)
    assert queue.push(newcomer, 2) is newcomer
    assert len(queue) == 2 and newcomer not in list(queue)


def test_removed_ticket_leaves_no_trace():
    queue = FairQueue()
    a, b = ticket("a", n=0), ticket("a", n=1)
    queue.push(a, DEEP)
    queue.push(b, DEEP)
    assert queue.remove(a) is True
    assert queue.remove(a) is False
    assert queue.position(b) == 0
    assert queue.depth("standard") == 1
    queue.remove(b)
    assert len(queue) == 0 and queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


class Unprintable:
    """A payload as large as a real waiter's: formatting it is a failure here."""

    def __repr__(self) -> str:
        raise AssertionError("the queue formatted a ticket's payload")


def test_a_ticket_that_left_by_any_path_is_not_looked_for():
    # Every queued request's own exit path removes its ticket, usually after the serving pass
    # took it; a miss must not scan the lane, nor format the ticket (deque.remove's
    # ValueError is built from the ticket's repr, its payload's included)
    queue = FairQueue()
    served, popped, shed, removed, other = (
        Ticket(t, p, 0.0, Unprintable()) for t, p in
        [("a", "standard"), ("b", "standard"), ("c", "sheddable"), ("a", "standard"), ("a", "standard")]
    )  # fmt: skip
    for t in (served, popped, shed, removed, other):
        queue.push(t, 5)
    refused = Ticket("d", "sheddable", 0.0, Unprintable())
    assert queue.push(refused, 5) is refused
    assert queue.serve(served) is True
    assert queue.pop() is popped
    assert queue.push(Ticket("e", "critical", 0.0, Unprintable()), 3) is shed  # full at 3
    assert queue.remove(removed) is True
    for gone in (served, popped, shed, removed, refused):
        assert queue.remove(gone) is False
        assert queue.serve(gone) is False
    assert len(queue) == 2 and list(queue)[1] is other  # the critical newcomer first
    assert queue.remove(other) is True and queue.depth("standard") == 0


def test_position_counts_tickets_served_before():
    queue = FairQueue()
    tickets = [ticket("a", n=0), ticket("a", n=1), ticket("b", n=0)]
    for t in tickets:
        queue.push(t, DEEP)
    assert [queue.position(t) for t in tickets] == [0, 2, 1]


def test_a_lower_bound_sheds_nobody_queued_and_refuses_newcomers_until_below_it():
    queue = FairQueue()
    for n in range(3):
        assert queue.push(ticket("a", n=n), 3) is None
    newcomer = ticket("b", n=0)
    assert queue.push(newcomer, 2) is newcomer  # a reload lowered the depth to 2
    assert len(queue) == 3
    queue.pop()
    queue.pop()
    assert queue.push(newcomer, 2) is None


def test_recent_sizes_keep_the_p95_of_the_last_ones_only():
    sizes = RecentSizes(keep=20)
    assert sizes.p95() is None
    for size in [500] * 20 + list(range(1, 21)):  # the large ones age out
        sizes.add(size)
    assert sizes.p95() == 20
    sizes.add(1000)  # one of twenty: the 95th percentile
    assert sizes.p95() == 1000
