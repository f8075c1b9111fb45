"""`kvgate top`: one frame of a running kvgate for scripts (`--once`), plain text off a terminal,
and a layout that tolerates the fields the routing work adds to /admin/replicas."""

from __future__ import annotations

import asyncio

from rich.console import Console

from kvgate.cli import main
from kvgate.tools.topview import Snapshot, frame
from tests.plugins.gateway import gateway_config

METRICS = """\
# TYPE kvgate_queue_depth gauge
kvgate_queue_depth{pool="default",priority="standard"} 3.0
# TYPE kvgate_requests counter
kvgate_requests_total{model="m",pool="default",tenant="acme",outcome="ok"} 10.0
# TYPE kvgate_tenant_tokens counter
kvgate_tenant_tokens_total{tenant="acme",kind="prompt"} 1000.0
kvgate_tenant_tokens_total{tenant="acme",kind="reserved"} 99999.0
# TYPE kvgate_refusals counter
kvgate_refusals_total{pool="default",tenant="acme",reason="queue_full"} 2.0
# TYPE kvgate_replica_headroom_requests gauge
kvgate_replica_headroom_requests{replica="r1",pool="default",basis="predicted"} 3.0
kvgate_replica_headroom_requests{replica="r1",pool="default",basis="worst_case"} 0.0
"""


def replica(**extra: object) -> dict[str, object]:
    return {"id": "r1", "pool": "default", "healthy": True, "num_gpu_blocks": 1000,
            "reserved_blocks": 880, "written_blocks": 260, "inflight": 4,
            "vllm": {"kv_usage": 0.26, "waiting": 2}, **extra}


def text(renderable: object) -> str:
    console = Console(width=160, color_system=None, force_terminal=False)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


def test_a_frame_shows_the_three_views_queue_headroom_and_totals():
    snap = Snapshot.parse("http://kv", {"replicas": [replica()]}, METRICS, at=1.0)
    out = text(frame(snap))
    row = next(line for line in out.splitlines() if line.lstrip().startswith("r1"))
    assert "88%" in row and "26%" in row  # reserved, written and vLLM's 26%
    # vLLM's queue; headroom at predicted demand / at the worst case (from /metrics); in flight
    assert row.split()[-5:] == ["2", "3", "/", "0", "4"]
    tenant = next(line for line in out.splitlines() if line.lstrip().startswith("acme"))
    assert tenant.split()[1:4] == ["1,000", "-", "2"]  # actual tokens only; no rate yet; 429s


def test_circuit_and_draining_are_shown_when_present_and_rates_need_two_frames():
    first = Snapshot.parse("http://kv", {"replicas": [replica()]}, METRICS, at=1.0)
    later = Snapshot.parse(
        "http://kv",
        {"replicas": [replica(circuit="open", draining=True,
                              headroom_requests={"predicted": 5, "worst_case": None})]},
        METRICS.replace("ok\"} 10.0", "ok\"} 30.0"), at=3.0,
    )
    out = text(frame(later, first))
    row = next(line for line in out.splitlines() if line.lstrip().startswith("r1"))
    assert "draining" in row and "open" in row
    assert row.split()[-4:-1] == ["5", "/", "-"]  # headroom from /admin/replicas wins
    pool = next(line for line in out.splitlines() if line.lstrip().startswith("default"))
    assert "10/s" in pool


async def test_once_prints_one_plain_frame_of_a_running_gateway(stub_factory, gateway_factory, capsys):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    (only,) = gw.gateway.registry
    code = await asyncio.to_thread(main, ["top", "--url", gw.url, "--once"])
    out = capsys.readouterr().out
    assert code == 0
    assert only.id in out and "replicas up" in out and "tenants" in out
    assert "\x1b[" not in out  # not a terminal: no colour, no cursor movement


def test_once_against_nothing_says_so_and_fails(capsys):
    assert main(["top", "--url", "http://127.0.0.1:9", "--once"]) == 1
    assert "cannot read" in capsys.readouterr().err
