"""The fleet benchmark's arithmetic, on hand-made results: no server, no clock."""

from __future__ import annotations

import dataclasses

import pytest
from fleetbench import capacity, fleet, metrics, report

from kvgate.tools.workload import Result, goodput, within_slo


def result(kind: str = "short", status: int = 200, ttft: float | None = 0.5,
           e2e: float | None = 3.0, tenant: str = "chat-app", code: str | None = None,
           tokens: int | None = 100, retry_after: float | None = None) -> Result:  # fmt: skip
    return Result(kind, tenant, status, ttft, code, e2e, None, None, 0.0, tokens, retry_after)


# Ten requests over 5 simulated seconds: which of them count toward goodput is written beside.
HAND_MADE = [
    result(ttft=0.2),  # good at 1 s and 2 s
    result(ttft=1.0),  # good at 1 s (the target is inclusive) and 2 s
    result(ttft=1.5),  # good at 2 s only
    result(ttft=2.5),  # too late for both
    result(kind="long", ttft=9.0, e2e=30.0),  # long: good (<= 10 s)
    result(kind="long", ttft=11.0, e2e=40.0),  # long: too late
    result(status=429, ttft=None, e2e=None, code="queue_timeout", tokens=None, retry_after=2.0),
    result(status=429, ttft=None, e2e=None, code="queue_timeout", tokens=None, retry_after=4.0),
    result(status=0, ttft=0.3, e2e=None, code="TimeoutError", tokens=None),  # first token, then cut
    result(status=503, ttft=None, e2e=None, code="no_replica", tokens=None),
]


def test_goodput_counts_completed_requests_within_their_kinds_target_per_second():
    assert goodput(HAND_MADE, 5.0, short_ttft_s=1.0, long_ttft_s=10.0) == pytest.approx(3 / 5)
    assert goodput(HAND_MADE, 5.0, short_ttft_s=2.0, long_ttft_s=10.0) == pytest.approx(4 / 5)


def test_a_request_that_timed_out_after_its_first_token_is_not_goodput():
    assert not within_slo(HAND_MADE[8], short_ttft_s=2.0, long_ttft_s=10.0)


def test_figures_split_outcomes_by_reason_and_compute_rates():
    counters = {"vllm:num_preemptions_total": 7.0, "vllm:prefix_cache_hits_total": 300.0,
                "vllm:prefix_cache_queries_total": 1200.0, "vllm:generation_tokens_total": 900.0}
    got = metrics.figures(HAND_MADE, 5.0, counters)
    assert got["requests"] == 10 and got["completed"] == 6
    assert got["refused"] == {"429 queue_timeout": 2}
    assert got["failed"] == {"503 no_replica": 1, "timeout": 1}
    assert got["goodput_per_s"] == {"short_ttft_1s": 0.6, "short_ttft_2s": 0.8}
    assert got["completed_per_s"] == 1.2
    assert got["output_tokens_per_s"] == 120.0  # six completed x 100 tokens / 5 s
    assert got["preemptions"] == 7 and got["prefix_cache_hit_rate"] == 0.25
    assert got["retry_after_s_median"] == 3.0
    # Latencies of completed requests only: the timed-out one's 0.3 s is not among them.
    assert got["ttft_s"]["short"] == {"p50": 1.0, "p99": 2.5, "n": 4}
    assert got["ttft_s"]["long"]["n"] == 2 and got["ttft_s"]["critical"]["n"] == 0
    assert got["by_tenant"]["chat-app"] == {
        "requests": 10, "completed": 6, "refused": {"429 queue_timeout": 2}, "failed": 2,
        "goodput_per_s": 0.8, "ttft_s": {"p50": 2.5, "p99": 11.0, "n": 6}}


def test_the_critical_floor_sets_each_ttft_against_what_an_idle_replica_allows():
    vip = [dataclasses.replace(result(tenant="vip", ttft=t), prompt_tokens=p)
           for t, p in ((0.3, 100), (0.9, 4000), (1.2, 600))]
    vip.append(result(tenant="vip", status=429, ttft=None, code="queue_timeout"))
    floors = {100: 0.1, 4000: 0.7, 600: 0.2}
    got = metrics.figures([*vip, result()], 5.0, {}, lambda r: floors[r.prompt_tokens])
    floor = got["critical_floor"]
    assert floor["floor_s"]["n"] == 3 and floor["floor_s"]["p99"] == 0.7
    assert floor["floor_above_target"] == 1  # 0.7 s > 0.5 s on an idle replica
    assert floor["over_floor_s"] == {"p50": 0.2, "p99": 1.0, "n": 3}  # 0.2, 0.2, 1.0
    assert "critical_floor" not in metrics.figures(vip, 5.0, {})


def test_the_floor_is_the_simulators_own_chunked_prefill_on_an_idle_replica():
    """step_overhead_s + tokens x prefill_token_s per chunk of max_num_batched_tokens: a prompt
    of 2,048 tokens is one step on a normal replica, 2,049 two."""
    normal, *_, long = fleet.replicas(dict.fromkeys(fleet.REPLICAS, 0), 0.25, {})
    timing = fleet.TIMING
    one = timing["step_overhead_s"] + 2048 * timing["prefill_token_s"]
    assert capacity.first_token_floor_s(normal, 2048) == pytest.approx(one)
    two = 2 * timing["step_overhead_s"] + 2049 * timing["prefill_token_s"]
    assert capacity.first_token_floor_s(normal, 2049) == pytest.approx(two)
    assert capacity.first_token_floor_s(long, 2049) < capacity.first_token_floor_s(normal, 2049)


def test_the_critical_class_queued_in_kvgate_is_read_from_its_histogram_in_simulated_seconds():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    waits = Histogram("kvgate_queue_wait_seconds", "", ["pool", "priority"],
                      buckets=(0.05, 0.1, 0.25), registry=registry)
    for pool, wall_s in (("default", 0.01), ("default", 0.2), ("long", 0.3), ("long", 0.08)):
        waits.labels(pool, "critical").observe(wall_s)
    waits.labels("default", "standard").observe(5.0)
    buckets = metrics.parse_queue_waits(generate_latest(registry).decode())
    assert buckets == {"0.05": 1.0, "0.1": 2.0, "0.25": 3.0, "+Inf": 4.0}
    # at time_scale 0.25, 0.5 simulated seconds is 0.125 wall: the 0.1 s bucket, 0.4 s simulated
    assert metrics.queued(buckets, 0.25) == {"queued": 4, "over_s": 0.4, "over": 2}
    assert report.cell({"critical_queued": metrics.queued(buckets, 0.25)},
                       ("critical_queued",), "queued") == "4 (2 > 0.4 s)"


def test_outcome_names_every_kind_of_failure():
    assert metrics.outcome(result(status=0, code="ServerDisconnectedError")) == (
        "failed", "dropped (ServerDisconnectedError)")
    assert metrics.outcome(result(status=0, code="stream_error")) == ("failed", "error mid-stream")
    assert metrics.outcome(result(status=400, code="context_length_exceeded")) == (
        "refused", "400 context_length_exceeded")


def test_wall_times_become_simulated_seconds():
    [sim] = metrics.to_simulated([result(ttft=0.25, e2e=1.0)], time_scale=0.25)
    assert (sim.ttft_s, sim.e2e_s, sim.sent_s) == (1.0, 4.0, 0.0)


def test_counters_are_summed_over_label_sets_and_other_samples_ignored():
    text = "\n".join([
        "# HELP vllm:num_preemptions_total Cumulative number of preemption.",
        "# TYPE vllm:num_preemptions_total counter",
        'vllm:num_preemptions_total{engine="0",model_name="a b"} 3.0',
        'vllm:num_preemptions_total{engine="1",model_name="c"} 2.0',
        'vllm:num_preemptions_created{engine="0",model_name="c"} 1.7e9',
        "vllm:prefix_cache_hits_total 10",
    ])
    got = metrics.parse_counters(text)
    assert got["vllm:num_preemptions_total"] == 5.0
    assert got["vllm:prefix_cache_hits_total"] == 10.0
    assert got["vllm:prefix_cache_queries_total"] == 0.0
    assert metrics.increase({"x": 1.0}, {"x": 4.0, "y": 2.0}) == {"x": 3.0, "y": 2.0}


def test_medians_over_repeats_count_a_missing_reason_as_zero():
    runs = [
        {"workload": "w", "load": 1.0, "contender": "c", "repeat": 0, "completed": 10,
         "refused": {"429 queue_timeout": 4}, "goodput_per_s": {"short_ttft_2s": 1.0}},
        {"workload": "w", "load": 1.0, "contender": "c", "repeat": 1, "completed": 12,
         "refused": {}, "goodput_per_s": {"short_ttft_2s": 2.0}},
        {"workload": "w", "load": 1.0, "contender": "c", "repeat": 2, "completed": 20,
         "refused": {"429 queue_timeout": 1}, "goodput_per_s": {"short_ttft_2s": 4.0}},
        {"workload": "w", "load": 1.0, "contender": "gone", "repeat": 0, "error": "no router"},
    ]
    rows = {r["contender"]: r for r in report.medians(runs)}
    assert rows["c"]["repeats"] == 3 and rows["c"]["completed"] == 12
    assert rows["c"]["refused"] == {"429 queue_timeout": 1}
    assert rows["c"]["goodput_per_s"] == {"short_ttft_2s": 2.0}
    assert rows["gone"] == {"workload": "w", "load": 1.0, "contender": "gone", "repeats": 0,
                            "error": "no router"}


def test_ratios_divide_each_contenders_goodput_by_the_baselines_at_the_same_load():
    rows = [{"workload": "w", "load": 2.0, "contender": name, "goodput_per_s": {"short_ttft_2s": g}}
            for name, g in (("direct-rr", 4.0), ("kvgate-predicted", 5.0))]
    text = report.ratios(rows)
    assert "| kvgate-predicted | 1.25 |" in text and "| direct-rr | 1.00 |" in text


@pytest.mark.parametrize("name", ["kvgate-worst", "kvgate-predicted", "kvgate-redis-x2"])
def test_the_gateway_config_the_benchmark_writes_is_one_kvgate_accepts(name):
    """Durations in simulated seconds reach kvgate multiplied by the fleet's time_scale."""
    from fleetbench import contenders, fleet, workloads

    from kvgate.config import parse_config

    contender = contenders.CONTENDERS[name]
    workload = workloads.WORKLOADS["realistic"]
    replicas = fleet.replicas({n: 8000 + i for i, n in enumerate(fleet.REPLICAS)}, 0.25,
                              workload.output_lengths)  # fmt: skip
    prefix = "bench-test" if contender.redis else None
    config = parse_config(contenders.kvgate_config(contender, replicas, workload, 0.25, 9000,
                                                   prefix))  # fmt: skip
    assert config.admission.mode == contender.mode
    assert config.admission.queue.target("standard") == pytest.approx(2.0 * 0.25)
    assert config.pools["long"].min_worst_case_tokens == workload.long_pool_min_tokens
    assert [r.name for r in config.pools["default"].replicas] == list(fleet.NORMAL)
    assert config.state.backend == ("redis" if contender.redis else "memory")


def test_the_defaults_contender_sets_no_latency_target_and_waits_kvgates_own_max_wait():
    """`kvgate-defaults` is kvgate as a user who configured nothing gets it: no target for any
    class, so nothing is refused early, and the default max_wait_s, in simulated seconds."""
    from fleetbench import contenders, fleet, workloads

    from kvgate.config import QueueConfig, parse_config

    workload = workloads.WORKLOADS["mix"]
    replicas = fleet.replicas({n: 8000 + i for i, n in enumerate(fleet.REPLICAS)}, 0.5,
                              workload.output_lengths)  # fmt: skip
    config = parse_config(contenders.kvgate_config(
        contenders.CONTENDERS["kvgate-defaults"], replicas, workload, 0.5, 9000, None))
    queue = config.admission.queue
    assert all(queue.target(c) is None for c in ("critical", "standard", "sheddable"))
    assert queue.max_wait_s == pytest.approx(QueueConfig().max_wait_s * 0.5)
    assert queue.max_depth == QueueConfig().max_depth


def test_the_events_contender_subscribes_to_every_replica_and_counts_token_ids_exactly():
    """On rag the replicas publish KV events on ports of their own, and `kvgate-events` reads
    them with the simulator's exact tokenizer; on a workload whose replicas publish none it
    does not run (its figures would be the fingerprint router's under another name)."""
    from fleetbench import contenders, fleet, workloads

    from kvgate.config import parse_config

    workload = workloads.WORKLOADS["rag"]
    events = {n: (7000 + 2 * i, 7001 + 2 * i) for i, n in enumerate(fleet.REPLICAS)}
    replicas = fleet.replicas({n: 8000 + i for i, n in enumerate(fleet.REPLICAS)}, 0.25,
                              workload.output_lengths, events_ports=events)  # fmt: skip
    assert all('"endpoint": "tcp://*:' in r.settings["kv_events_config"] for r in replicas)
    contender = contenders.CONTENDERS["kvgate-events"]
    config = parse_config(contenders.kvgate_config(contender, replicas, workload, 0.25, 9000,
                                                   None))  # fmt: skip
    assert config.pools["default"].kv_events is not None
    first = config.pools["default"].replicas[0]
    assert first.kv_events is not None and first.kv_events.endpoint == "tcp://127.0.0.1:7000"
    assert config.model("sim-model").tokenizer.special_tokens == {"<|im_start|>": 100264,
                                                                  "<|im_end|>": 100265}
    plain = parse_config(contenders.kvgate_config(contenders.CONTENDERS["kvgate-predicted"],
                                                  replicas, workload, 0.25, 9000, None))
    assert plain.pools["default"].kv_events is None
    assert contenders.available(contender, workloads.WORKLOADS["mix"]) is not None
    assert contenders.available(contender, workload) is None


def test_the_rag_workload_asks_about_few_documents_under_one_system_prompt():
    from fleetbench import workloads

    items = workloads.build_rag(0, 36.0, 5.0)
    assert 120 <= len(items) <= 240
    systems = {i.body["messages"][0]["content"] for i in items}
    documents = {i.body["messages"][1]["content"].split(":", 1)[0] for i in items}
    assert len(systems) == 1 and len(documents) == workloads.RAG_DOCUMENTS
    assert items == sorted(items, key=lambda i: i.at_s)
    again = workloads.build_rag(1, 36.0, 5.0)  # another seed: other arrivals, same documents
    assert again[0].body["messages"][1]["content"].split("\n\n")[0] in {
        i.body["messages"][1]["content"].split("\n\n")[0] for i in items}
