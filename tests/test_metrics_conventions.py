"""kvgate's metric names follow Prometheus' conventions: counters for cumulative figures,
named `_total`; every other name ends in its unit."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvgate.metrics import Metrics

UNITS = ("_seconds", "_blocks", "_tokens", "_requests", "_ratio")
# Names whose value is a count of nothing in particular, a state or a fitted term: no unit.
UNITLESS = {
    "kvgate_queue_depth",  # requests waiting; the name DESIGN.md gives it
    "kvgate_replica_healthy",  # 0 or 1
    "kvgate_replica_circuit_state",  # 0 closed, 1 half open, 2 open
    "kvgate_replica_draining",  # 0 or 1
    "kvgate_prompt_fingerprints",  # distinct fingerprints: the name is the unit
    "kvgate_state_store_up",  # 0 or 1
    "kvgate_tokenizer_calibration_terms",  # a fitted term, by `term`
}


def test_gauges_and_histograms_end_in_their_unit_and_never_in_total():
    for value in vars(Metrics()).values():
        if not hasattr(value, "_labelnames") or value._type == "counter":
            continue
        name = value._name
        assert not name.endswith("_total"), f"{name} is a {value._type} named like a counter"
        assert name.endswith(UNITS) or name in UNITLESS, f"{name} has no unit in its name"


def test_a_mirrored_counter_follows_its_source_and_counts_on_after_a_reset():
    metrics = Metrics()
    counter = metrics.vllm_preemptions
    for figure in (5, 5, 9, 2, 4):  # the replica restarted after 9
        metrics.mirror(counter, ("r1",), figure)
    families = text_string_to_metric_families(metrics.render().decode())
    (value,) = [
        s.value for f in families for s in f.samples
        if s.name == "kvgate_replica_vllm_preemptions_total" and s.labels == {"replica": "r1"}
    ]
    assert value == 9 + 4
