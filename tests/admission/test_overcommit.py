"""The overcommit controller learns its limit from what comes before a preemption: pure, fed
one scrape at a time, no clock."""

from __future__ import annotations

from kvgate.admission.overcommit import HIGH_WATER, LOW, ROOM, Overcommit


def scrape(controller: Overcommit, usage: float, waiting: float = 0, preemptions: float = 0,
           demand: bool = True) -> float:
    return controller.observe("r", preemptions=preemptions, kv_usage=usage, demand=demand,
                              waiting=waiting, rejections=0)


def test_the_factor_backs_off_as_vllms_cache_nears_full_before_any_preemption():
    controller = Overcommit()
    for _ in range(5):  # room and demand: it grows
        scrape(controller, 0.5)
    grown = controller.factor("r")
    assert grown > 1.4
    assert scrape(controller, 0.9) == grown  # above the room mark: it stops growing
    # answers outgrow their predictions: the cache fills towards the point where vLLM must
    # preempt; the factor shrinks on every scrape at the high-water mark, none preempted yet
    factors = [scrape(controller, usage) for usage in (0.95, 0.97, 0.98)]
    assert factors[0] < grown and factors[1] < factors[0] and factors[2] < factors[1]
    # and it does not grow back while the cache stays above the room mark
    assert scrape(controller, 0.88) == factors[2]


def test_vllms_own_queue_growing_while_its_cache_is_high_shrinks_the_factor_below_one():
    """vLLM accepted more than it can start, for want of blocks: kvgate's reservations are
    beyond what the replica holds. Before that turns into preemptions, admit less."""
    controller = Overcommit()
    factors = [scrape(controller, 0.9, waiting=w) for w in (0, 1, 3, 6)]
    assert factors[0] == 1.0
    assert factors[1] < 1.0 and factors[3] < factors[2] < factors[1]
    assert factors[3] >= LOW


def test_a_queue_that_is_not_growing_or_a_cache_with_room_does_not_shrink_it_below_one():
    controller = Overcommit()
    assert [scrape(controller, 0.9, waiting=3) for _ in range(3)][1:] == [1.0, 1.0]
    assert scrape(controller, 0.4, waiting=8) == 1.0  # the queue grew, but blocks are free


def test_without_demand_or_with_no_usage_known_nothing_grows():
    controller = Overcommit()
    scrape(controller, 0.3, demand=False)
    assert controller.observe("r", preemptions=0, kv_usage=None, demand=True) == 1.0
    assert controller.factor("r") == 1.0
    assert ROOM < HIGH_WATER < 1.0
