"""Output-length prediction and the overcommit controller: pure, fed values, no clock."""

from __future__ import annotations

import random

from kvgate.overcommit import HIGH, LOW, Overcommit
from kvgate.prediction import OutputPredictor


def test_nothing_is_predicted_until_enough_answers_are_known():
    predictor = OutputPredictor(min_samples=16)
    for _ in range(15):
        predictor.observe("t", "m", 100)
    assert predictor.predict("t", "m", 4096) is None
    predictor.observe("t", "m", 100)
    assert predictor.predict("t", "m", 4096) == 100


def test_the_prediction_is_a_high_quantile_capped_by_max_tokens():
    predictor = OutputPredictor(quantile=0.95, window=1000)
    rng = random.Random(3)
    lengths = [int(rng.lognormvariate(5.5, 0.6)) for _ in range(1000)]  # median ~245
    for n in lengths:
        predictor.observe("t", "m", n)
    p95 = sorted(lengths)[950]
    assert predictor.predict("t", "m", 4096) == p95
    assert predictor.predict("t", "m", 64) == 64


def test_a_new_tenant_borrows_the_models_answers_and_old_answers_leave_the_window():
    predictor = OutputPredictor(min_samples=4, window=8)
    for _ in range(8):
        predictor.observe("busy", "m", 500)
    assert predictor.predict("new", "m", 4096) == 500
    for _ in range(8):
        predictor.observe("busy", "m", 20)
    assert predictor.predict("busy", "m", 4096) == 20  # the 500s fell out of the window


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
    for _ in range(100):
        full.observe("r", preemptions=0, kv_usage=0.95, demand=True)
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
