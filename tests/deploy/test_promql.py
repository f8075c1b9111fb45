"""The reference checker the dashboard and alert tests rely on catches what it must."""

from __future__ import annotations

from tests.deploy.promql import exported, references, unknown


def test_metric_and_label_names_are_told_apart_from_functions_variables_and_strings():
    names, labels = references(
        'histogram_quantile(0.95, sum by (pool, le) (rate(kvgate_queue_wait_seconds_bucket'
        '{pool=~"$pool"}[$__rate_interval]))) > 0.5 * vllm:num_requests_waiting offset 1h'
    )
    assert names == {"kvgate_queue_wait_seconds_bucket", "vllm:num_requests_waiting"}
    assert labels == {"pool", "le"}


def test_a_misspelt_metric_or_label_is_reported():
    problems = unknown('sum by (replika) (kvgate_replica_vllm_preemptions{replica="a"})', exported())
    assert problems == [
        "no such metric: kvgate_replica_vllm_preemptions",
        "no such label: replica",
        "no such label: replika",
    ]
