"""The Grafana dashboard is the one kvgate/tools/dashboard.py generates, and every expression on it
names only series and labels that kvgate or vLLM (the simulator) export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvgate.tools.dashboard import render
from tests.deploy.promql import exported, unknown

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvgate.json"


def expressions(board: dict) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(metric{...}, label): check the selector, and the label on it
            match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
            assert match, variable
            exprs.append(f"sum by ({match.group(2)}) ({match.group(1)})")
    return exprs


def test_the_committed_dashboard_is_the_generated_one():
    assert DASHBOARD.read_text() == render(), "run: python -m kvgate.tools.dashboard > " + str(DASHBOARD)


def test_every_expression_names_only_exported_series_and_labels():
    series = exported()
    board = json.loads(DASHBOARD.read_text())
    problems = {e: unknown(e, series) for e in expressions(board)}
    assert {e: p for e, p in problems.items() if p} == {}


def test_it_is_importable_with_a_datasource_variable_and_pool_and_replica_selectors():
    board = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"pool", "replica"} <= variables.keys()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    kv = next(p for p in panels if p["title"].startswith("KV cache of"))
    assert kv["repeat"] == "replica"
    assert [t["legendFormat"] for t in kv["targets"]] == [
        "reserved (worst case)", "written", "vLLM-reported", "admissible limit"
    ]
