"""The overcommit controller: pure, fed values, no clock (the length model: test_lengths)."""

from __future__ import annotations

from kvgate.admission.overcommit import HIGH, LOW, Overcommit


def test_overcommit_grows_while_there_is_room_and_demand_and_backs_off_on_preemption():
    controller = Overcommit()
    assert controller.factor("r") == 1.0
    for _ in range(5):
        controller.observe("r", preemptions=0, kv_usage=0.4, demand=True)
    assert controller.factor("r") > 1.2
    before = controller.factor("r")
    controller.observe("r", preemptions=3, kv_usage=0.4, demand=True)
    assert controller.factor("r") == before * 0.7
    controller.observe("r", preemptions=3, kv_usage=0.4, demand=False)  # no demand: holds
    assert controller.factor("r") == before * 0.7


def test_overcommit_stays_within_bounds_and_needs_room_to_grow():
    controller = Overcommit()
    for i in range(100):
        controller.observe("r", preemptions=float(i), kv_usage=0.2, demand=True)
    assert controller.factor("r") == LOW
    full = Overcommit()
    for _ in range(100):  # above the room mark, below the high-water mark: it holds
        full.observe("r", preemptions=0, kv_usage=0.9, demand=True)
    assert full.factor("r") == 1.0
    free = Overcommit()
    for _ in range(100):
        free.observe("r", preemptions=0, kv_usage=0.1, demand=True)
    assert free.factor("r") == HIGH


def test_overcommit_stops_growing_and_shrinks_back_while_the_replica_queues_work_itself():
    controller = Overcommit()
    for _ in range(5):
        controller.observe("r", preemptions=0, kv_usage=0.3, demand=True, waiting=0)
    grown = controller.factor("r")
    assert grown > 1.2
    controller.observe("r", preemptions=0, kv_usage=0.3, demand=True, waiting=6)
    assert 1.0 <= controller.factor("r") < grown


def test_overcommit_backs_off_when_the_replicas_own_queue_limits_refuse_work():
    controller = Overcommit()
    for _ in range(5):
        controller.observe("r", preemptions=0, kv_usage=0.3, demand=True, rejections=2)
    grown = controller.factor("r")
    assert grown > 1.2  # refusals counted before, none new: it grows
    controller.observe("r", preemptions=0, kv_usage=0.3, demand=True, rejections=5)
    assert controller.factor("r") == grown * 0.7
    controller.observe("r", preemptions=0, kv_usage=0.3, demand=True, rejections=0)  # restarted
    assert controller.factor("r") > grown * 0.7


def test_overcommit_grows_half_the_way_to_what_the_replica_really_holds_per_reserved_block():
    """The ledger reserves twice what vLLM holds: the factor moves half the way to 2 per
    scrape instead of +0.1 (a 20 s ramp at a 2 s discovery interval), never past HIGH, and
    a ratio below the factor still lets it creep up by the step alone."""
    controller = Overcommit()
    for expected in (1.5, 1.75):
        factor = controller.observe("r", preemptions=0, kv_usage=0.5, demand=True,
                                    reserved_per_held=2.0)  # fmt: skip
        assert factor == expected
    assert controller.observe("r", preemptions=0, kv_usage=0.5, demand=True,
                              reserved_per_held=1.0) == 1.85  # fmt: skip
    assert controller.observe("r", preemptions=0, kv_usage=0.5, demand=True,
                              reserved_per_held=9.0) == HIGH  # fmt: skip
    held = Overcommit()  # without demand, or without room, nothing grows however far it could
    assert held.observe("r", preemptions=0, kv_usage=0.5, demand=False,
                        reserved_per_held=2.0) == 1.0  # fmt: skip
    assert held.observe("r", preemptions=0, kv_usage=0.9, demand=True,
                        reserved_per_held=2.0) == 1.0  # fmt: skip


def test_after_its_first_sign_of_a_limit_the_factor_grows_a_step_at_a_time():
    """A jump right after an ease would undo it within a scrape: on mix at 3x the factor went
    from 1.8 back to 2.0 at once, and the replica preempted 12 times. Once the replica has shown
    its limit (near-full cache, a preemption, its own queue), growth is +0.1 a scrape."""
    for sign in ({"kv_usage": 0.97}, {"preemptions": 1.0}, {"waiting": 3.0}):
        controller = Overcommit()
        controller.observe("r", preemptions=0, kv_usage=0.5, demand=True, reserved_per_held=2.0)
        assert controller.factor("r") == 1.5
        controller.observe("r", **{"preemptions": 0, "kv_usage": 0.5, "demand": True, **sign})
        eased = controller.factor("r")
        assert eased < 1.5
        grown = controller.observe("r", preemptions=sign.get("preemptions", 0), kv_usage=0.5,
                                   demand=True, reserved_per_held=3.0)  # fmt: skip
        assert grown == eased + 0.1
