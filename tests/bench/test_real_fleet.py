"""The real-engine fleet benchmark's pure parts: workloads, plan, kvgate's config, the table.
No engine is started (bench/real_fleet.py does that)."""

from __future__ import annotations

import itertools

import real_fleet
from fleetbench import contenders, real

from kvgate.config import parse_config
from kvgate.tools.tiny_model import MODEL_NAME
from kvgate.tools.workload import Result


def test_chats_are_seeded_open_loop_arrivals_at_about_the_rate():
    first, again = real.build_chats(3, 100.0, 5.0), real.build_chats(3, 100.0, 5.0)
    assert first == again
    assert 400 < len(first) < 600
    assert all(0 <= a.at_s <= b.at_s < 100.0 for a, b in itertools.pairwise(first))
    assert {i.body["model"] for i in first} == {MODEL_NAME}
    assert all(i.body["max_tokens"] == real.MAX_TOKENS for i in first)


def test_a_burst_is_its_count_of_chats_within_its_spread():
    burst = real.build_burst(0, 98, 2.5)
    assert len(burst) == 98 and all(0 <= i.at_s < 2.5 for i in burst)


def test_every_repeat_runs_the_same_chats_for_every_contender_in_alternating_order():
    args = real_fleet.parse_args(["--parts", "burst", "loads", "--loads", "1", "2",
                                  "--repeats", "2"])  # fmt: skip
    runs = real_fleet.plan(args, 4.0)
    first = [r.contender.name for r in runs if r.repeat == 0 and r.load == 1]
    second = [r.contender.name for r in runs if r.repeat == 1 and r.load == 1]
    assert first == real_fleet.CONTENDERS and second == first[::-1]
    for repeat in (0, 1):
        loaded = [r for r in runs if r.repeat == repeat and r.load == 2]
        assert all(r.items == loaded[0].items for r in loaded)
    assert [r.contender.name for r in runs if r.part == "burst" and r.repeat == 1] == [
        "kvgate-defaults", "direct-rr"]  # fmt: skip


def test_kvgate_in_front_of_one_pool_counts_with_the_engines_tokenizer():
    fleet = [real.Replica("engine-0", "default", 8001, {}), real.Replica("engine-1", "default",
                                                                         8002, {})]  # fmt: skip
    models = [{"name": MODEL_NAME, "tokenizer": {"kind": "huggingface", "file": "t.json"}}]
    config = contenders.kvgate_config(contenders.CONTENDERS["kvgate-defaults"], fleet,
                                      real.CHATS, 1.0, 9000, None, models)  # fmt: skip
    assert list(config["pools"]) == ["default"]
    assert parse_config(config).model(MODEL_NAME).tokenizer.kind == "huggingface"
    assert config["models"] == models
    assert "ttft_target_s" not in config["admission"]["queue"]
    targets = contenders.kvgate_config(contenders.CONTENDERS["kvgate-predicted"], fleet,
                                       real.CHATS, 1.0, 9000, None, models)  # fmt: skip
    assert targets["admission"]["queue"]["ttft_target_s"] == contenders.TTFT_TARGET_S


def test_the_makespan_runs_from_the_first_send_to_the_last_completed_answer():
    done = Result("short", "vip", 200, 0.1, None, 4.0, None, None, 1.0, 100, prompt_tokens=150)
    cut = Result("short", "vip", 0, None, "TimeoutError", None, None, None, 0.5)
    figures = real.whole_run([done, cut], 10.0)
    assert figures["makespan_s"] == 4.5
    assert figures["output_tokens_per_makespan_s"] == round(100 / 4.5, 1)
    assert (figures["all_completed"], figures["all_sent"]) == (1, 2)


def test_cores_used_by_others_are_the_machines_less_this_benchmarks():
    use = real.cpu_use((10.0, 4.0), (30.0, 20.0), 10.0)
    assert use == {"machine_cores": 2.0, "own_cores": 1.6, "foreign_cores": 0.4}
