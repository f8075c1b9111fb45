"""`kvgate demo --workload`: the whole story on one machine, end to end."""

from __future__ import annotations

import orjson

from kvgate.cli import main


def test_demo_workload_runs_both_ways_and_kvgate_never_preempts(capsys):
    code = main(["demo", "--workload", "--json", "--duration", "3", "--rate", "30",
                 "--time-scale", "0.5", "--seed", "7"])
    assert code == 0
    report = orjson.loads(capsys.readouterr().out)
    requests = report["workload"]["requests"]
    assert requests > 50 and report["workload"]["long"] > 0
    bare, gated = report["no_admission"], report["kvgate"]
    for side in (bare, gated):
        assert side["failed"] == 0
        assert side["completed"] + sum(side["refused"].values()) == requests
        assert side["ttft_s"]["short"]["n"] > 0
    # The same overload preempts on the bare fleet and never through kvgate.
    assert sum(r["preemptions"] for r in bare["replicas"].values()) > 0
    assert sum(r["preemptions"] for r in gated["replicas"].values()) == 0
    # A shared system prompt gives the chat replicas most of their prompt tokens from cache.
    assert gated["replicas"]["normal-a"]["prefix_hit_rate"] > 0.5
