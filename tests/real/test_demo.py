"""`kvgate demo --workload --vllm`: the demo's table, made on real engines."""

from __future__ import annotations

import orjson
import pytest

from kvgate.cli import main

pytestmark = pytest.mark.timeout(300)


def test_the_demo_runs_its_four_columns_on_real_engines(capsys):
    code = main(["demo", "--workload", "--vllm", "--json", "--duration", "8", "--rate", "3",
                 "--seed", "2"])
    assert code == 0
    report = orjson.loads(capsys.readouterr().out)
    workload = report["workload"]
    assert workload["fleet"] == "vllm-cpu" and workload["long"] >= 1
    requests = workload["requests"]
    for key in ("no_admission", "worst_case", "predicted_raw", "predicted"):
        side = report[key]
        assert side["failed"] == 0, (key, side)
        assert side["completed"] + sum(side["refused"].values()) == requests, (key, side)
        assert side["ttft_s"]["long"]["n"] == workload["long"], (key, side)  # documents fit
        assert set(side["replicas"]) == {"normal-a", "normal-b", "long"}
        assert side["replicas"]["long"]["finished"] >= workload["long"]
    # admitting on the worst case, the engines never preempt
    assert report["worst_case"]["preemptions"] == 0
