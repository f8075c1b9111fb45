"""bench/fleet.py end to end on a tiny profile: real processes, real sockets, a few seconds."""

from __future__ import annotations

import importlib.util

import fleet  # bench/fleet.py
import orjson
import pytest

RUN_FIELDS = {"workload", "load", "rate_per_s", "contender", "repeat", "requests", "completed",
              "refused", "failed", "ttft_s", "e2e_s", "goodput_per_s", "completed_per_s",
              "output_tokens_per_s", "preemptions", "prefix_cache_hit_rate", "generation_tokens",
              "retry_after_s_median", "run", "samples", "critical_floor"}  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.slow
# bench/fleet.py runs on a loop of its own, under this test's frame, and writes its figures
# there; kvgate and the simulators it measures are processes of their own.
@pytest.mark.blocking_allowed
def test_a_tiny_run_of_two_contenders_writes_every_figure(tmp_path, capsys):
    code = fleet.main(["--workloads", "realistic", "--contenders", "direct-rr", "kvgate-predicted",
                       "--loads", "2", "--warmup", "2", "--duration", "4",
                       "--ttft-timeout", "8", "--timeout", "12",
                       "--out-dir", str(tmp_path)])  # fmt: skip
    assert code == 0
    [path] = tmp_path.glob("fleet-*.json")
    document = orjson.loads(path.read_bytes())
    assert set(document) == {"meta", "capacity", "results", "runs", "plots"}
    assert document["capacity"]["realistic"]["requests_per_s"] > 0
    assert document["meta"]["settings"]["loads"] == [2.0]
    runs = {r["contender"]: r for r in document["runs"]}
    assert set(runs) == {"direct-rr", "kvgate-predicted"}
    for run in runs.values():
        assert set(run) >= RUN_FIELDS, set(run) ^ RUN_FIELDS
        # Every request sent ends one way or another, and both contenders got the same ones.
        ended = run["completed"] + sum(run["refused"].values()) + sum(run["failed"].values())
        assert ended == run["requests"] == runs["direct-rr"]["requests"] > 0
        for group in ("short", "long", "critical"):
            assert set(run["ttft_s"][group]) == {"p50", "p99", "n"}
        assert set(run["goodput_per_s"]) == {"short_ttft_1s", "short_ttft_2s"}
        assert run["goodput_per_s"]["short_ttft_1s"] <= run["goodput_per_s"]["short_ttft_2s"]
        assert set(run["run"]["sim_speed"]) == {"normal-a", "normal-b", "normal-c", "long"}
        assert run["samples"]["short_requests"] >= len(run["samples"]["short_ttft_s"])
        assert run["critical_floor"]["floor_s"]["n"] == run["ttft_s"]["critical"]["n"]
        # what kvgate's own histogram says of the critical class; a bare fleet has none
        assert ("critical_queued" in run) == (run["contender"] == "kvgate-predicted")
    assert {r["contender"] for r in document["results"]} == set(runs)
    summary = (tmp_path / "fleet.md").read_text()
    assert "kvgate-predicted" in summary and "goodput@2s" in summary and "per tenant" in summary
    out = capsys.readouterr().out
    assert "direct-rr" in out and "goodput@1s" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert sorted(document["plots"]) == sorted(p.name for p in tmp_path.glob("*.png"))
        assert len(document["plots"]) == 2  # goodput against load, TTFT CDF at 2x
    # The outputs can be written again from the results file alone, measuring nothing.
    again = tmp_path / "again"
    assert fleet.main(["--from-json", str(path), "--out-dir", str(again)]) == 0
    assert (again / "fleet.md").read_text() == summary
