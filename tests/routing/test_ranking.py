"""A ranking's usable replicas: the held one alone while its hold lasts, never a busy one."""

from __future__ import annotations

from kvgate.routing.ranking import Hold, Ranking
from tests.routing.fleets import fleet, replica


def ids(views: list) -> list[str]:
    return [v.id for v in views]


def test_the_held_replica_alone_is_usable_until_the_hold_ends():
    views = list(fleet(replica("a"), replica("b")))
    ranking = Ranking(views, hold=Hold(views[1], 0.25))
    assert ids(ranking.usable(0.0)) == ["b"]
    assert ids(ranking.usable(0.25)) == ["a", "b"]
    assert ids(Ranking(views).usable(0.0)) == ["a", "b"]


def test_a_busy_replica_is_never_usable_and_ends_its_hold_at_once():
    views = list(fleet(replica("a"), replica("b"), busy=frozenset({"b"})))
    ranking = Ranking(views, hold=Hold(views[1], 10.0))
    assert ids(ranking.usable(0.0)) == ["a"]
    all_busy = list(fleet(replica("a"), busy=frozenset({"a"})))
    assert Ranking(all_busy).usable(0.0) == []
