"""`bench/fleet.py --ab TREE`: each kvgate contender also runs from another checkout, in the
same run (before against after on the same workload, fleet and machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import fleet  # bench/fleet.py
from fleetbench import contenders, report
from fleetbench.processes import Children


def test_ab_adds_a_base_run_of_every_kvgate_contender_and_no_other(tmp_path):
    args = fleet.parse_args([
        "--ab", str(tmp_path), "--workloads", "realistic",
        "--contenders", "direct-rr", "vllm-router-cache_aware", "kvgate-predicted", "kvgate-worst",
    ])
    assert args.contenders == ["direct-rr", "vllm-router-cache_aware", "kvgate-predicted",
                               "kvgate-worst", "kvgate-predicted@base", "kvgate-worst@base"]  # fmt: skip
    base = contenders.named("kvgate-predicted@base", args.ab)
    assert base.tree == str(tmp_path) and base.mode == "predicted"
    assert contenders.named("kvgate-predicted", args.ab).tree is None
    # every run of the plan is one of them, each contender in every cell
    specs = fleet.plan(args, {"realistic": 1.0})
    assert {s.contender.name for s in specs} == set(args.contenders)


def test_the_report_shows_the_code_before_right_after_the_code_after():
    rows = [{"load": 1.0, "contender": name} for name in
            ("kvgate-predicted@base", "direct-rr", "kvgate-predicted", "kvgate-worst@base",
             "kvgate-worst")]  # fmt: skip
    assert [r["contender"] for r in sorted(rows, key=report.row_order)] == [
        "direct-rr", "kvgate-worst", "kvgate-worst@base", "kvgate-predicted",
        "kvgate-predicted@base",
    ]


def test_a_base_process_imports_kvgate_from_its_own_checkout(tmp_path):
    tree = tmp_path / "base"
    (tree / "kvgate").mkdir(parents=True)
    (tree / "kvgate" / "__init__.py").write_text("")
    children = Children(tmp_path)
    children.start("probe", [sys.executable, "-c", "import kvgate; print(kvgate.__file__)"],
                   env={"PYTHONPATH": str(tree)}, cwd=tree)  # fmt: skip
    try:
        children.procs["probe"].wait(timeout=30)
    except subprocess.TimeoutExpired:
        children.stop()
        raise
    printed = (tmp_path / "probe.log").read_text().strip()
    assert Path(printed) == tree / "kvgate" / "__init__.py", printed
