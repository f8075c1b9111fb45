"""Bounded load: an affinity is honoured while its replica stays within its share."""

from __future__ import annotations

from kvgate.routing.bounded import within_bound
from tests.routing.fleets import fleet, replica


def test_bounded_load_counts_capacity_not_replicas():
    big, small = replica("big", blocks=3000), replica("small", blocks=1000)
    reserved = {"big": 1500, "small": 500}  # each at half its capacity: both within bounds
    views = list(fleet(big, small, reserved=reserved))
    assert all(within_bound(v, views, 10, 0.25) for v in views)
    # the small one at 3/4 of the pool's blocks is over 1.25 × its quarter
    skewed = list(fleet(big, small, reserved={"big": 500, "small": 1500}))
    assert [v.id for v in skewed if within_bound(v, skewed, 10, 0.25)] == ["big"]
