"""`kvgate demo --workload`: the whole story on one machine, end to end."""

from __future__ import annotations

import openai
import orjson
import pytest

from kvgate.cli import main
from kvgate.commands import demo, demo_report
from kvgate.request.tokenizers import load_tiktoken


@pytest.mark.slow
def test_demo_workload_runs_three_ways_and_worst_case_never_preempts(capsys):
    code = main(["demo", "--workload", "--json", "--duration", "3", "--rate", "30",
                 "--time-scale", "0.5", "--seed", "7"])
    assert code == 0
    report = orjson.loads(capsys.readouterr().out)
    requests = report["workload"]["requests"]
    assert requests > 50 and report["workload"]["long"] > 0
    bare, worst, predicted = report["no_admission"], report["worst_case"], report["predicted"]
    for side in (bare, worst, predicted):
        assert side["failed"] == 0
        assert side["completed"] + sum(side["refused"].values()) == requests
        assert side["ttft_s"]["short"]["n"] > 0
        # Goodput counts completed requests only, per simulated second of the workload.
        assert 0 <= side["goodput_per_s"] <= side["completed"] / (3 / 0.5) + 0.001
        assert side["preemptions"] == sum(r["preemptions"] for r in side["replicas"].values())
    # The chats' classes have a latency target: what kvgate refuses for it, it refuses at
    # arrival; the batch class has none, and is never refused for one.
    for side in (worst, predicted):
        early = side["refused_at_arrival"]
        assert sum(early.values()) == side["refused"].get("429 wait_budget_exceeded", 0)
        assert early["batch"] == 0
        assert "429 queue_timeout" not in side["refused"]
    # The same overload preempts on the bare fleet and never under worst-case admission.
    assert bare["preemptions"] > 0
    assert worst["preemptions"] == 0
    # A shared system prompt gives the chat replicas most of their prompt tokens from cache.
    chat = [worst["replicas"][name] for name in ("normal-a", "normal-b")]
    hits = sum(r["prefix_cache_hits"] for r in chat)
    assert hits / sum(r["prefix_cache_queries"] for r in chat) > 0.5
    assert worst["prefix_hit_rate"] is not None
    # Normalization (timestamps relocated, blanks and CRLF gone) makes the noisy chats hit too.
    raw = report["predicted_raw"]
    assert raw["failed"] == 0 and raw["completed"] + sum(raw["refused"].values()) == requests
    assert chat_hit_rate(predicted) > chat_hit_rate(raw)


def chat_hit_rate(side: dict) -> float:
    """The chat replicas' prefix-cache hit rate (the long documents share nothing)."""
    chats = [side["replicas"][name] for name in ("normal-a", "normal-b")]
    return sum(r["prefix_cache_hits"] for r in chats) / sum(r["prefix_cache_queries"] for r in chats)


def test_demo_table_has_a_column_per_way_and_a_goodput_row():
    """The text report names the three columns and lays goodput beside the latencies."""
    side = {"completed": 2, "failed": 0, "refused": {"429 queue_timeout": 1},
            "goodput_per_s": 0.5, "preemptions": 3, "prefix_hit_rate": 0.25,
            "ttft_s": {"short": {"p50": 0.1, "p99": 0.2}, "long": {"p50": None, "p99": None}},
            "e2e_s": {"short": {"p50": 1.0, "p99": 2.0}, "long": {"p50": None, "p99": None}},
            "replicas": {"normal-a": {"preemptions": 3, "prefix_hit_rate": 0.25}},
            "refused_at_arrival": {"vip": 0, "chat-app": 4, "batch": 0}}
    report = {"workload": {"requests": 3, "long": 0, "duration_s": 1, "rate_per_s": 3,
                           "time_scale": 1.0},
              "no_admission": side, "worst_case": side, "predicted": side}
    text = demo_report.render(report)
    header = next(line for line in text.splitlines() if "no admission" in line)
    assert "kvgate worst" in header and "kvgate predicted" in header
    goodput = next(line for line in text.splitlines() if line.startswith("goodput (req/s"))
    assert goodput.split()[-3:] == ["0.500"] * 3
    refused = next(line for line in text.splitlines() if "queue_timeout" in line)
    assert refused.split()[-3:] == ["1"] * 3
    early = next(line for line in text.splitlines() if line.startswith("refused at arrival: chat"))
    assert early.split()[-3:] == ["4"] * 3
    assert "batch (sheddable) has no target" in text


def test_the_demo_sets_latency_targets_for_its_interactive_classes_only():
    sims = {name: type("Sim", (), {"url": f"http://127.0.0.1:{9000 + i}"})()
            for i, name in enumerate(("normal-a", "normal-b", "long"))}
    queue = demo.gateway_config(demo.SimFleet(sims), 0, time_scale=0.5).admission.queue  # type: ignore[arg-type]
    assert queue.target("critical") == queue.target("standard") == 1.0  # 2 s simulated
    assert queue.target("sheddable") is None


@pytest.mark.slow
async def test_the_readme_snippet_works_against_the_demo_fleet():
    """What the demo's banner tells a new user to run, with its api_key, completes."""
    fleet = demo.SimFleet(await demo.start_fleet(load_tiktoken(), time_scale=0.01))
    runner, url = await demo.start_gateway(demo.gateway_config(fleet, 0))
    try:
        assert 'api_key="demo"' in demo.banner(url, fleet)
        for key in ("demo", "vip"):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            reply = await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert reply.choices[0].message.content
            await client.close()
    finally:
        await runner.cleanup()
        await demo.stop_fleet(fleet.replicas)


def test_the_workload_ends_by_saying_how_to_watch_the_fleet_with_kvgate_top():
    from kvgate.commands.demo import top_hint

    hint = top_hint("http://127.0.0.1:8080")
    assert "kvgate demo --port 8080" in hint
    assert "kvgate top --url http://127.0.0.1:8080 --admin-key demo-admin --once" in hint


@pytest.mark.slow
def test_demo_plot_writes_the_kv_lines_and_the_ttft_cdfs(tmp_path, capsys):
    code = main(["demo", "--workload", "--json", "--duration", "2", "--rate", "30",
                 "--time-scale", "0.5", "--seed", "3", "--plot", str(tmp_path)])
    assert code == 0
    for name in ("kv-normal-a.png", "ttft-cdf.png"):
        png = (tmp_path / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, name


def test_demo_plot_needs_the_workload(tmp_path, capsys):
    assert main(["demo", "--plot", str(tmp_path)]) == 2
    assert "--plot needs --workload" in capsys.readouterr().err


@pytest.mark.slow
async def test_the_demo_gateway_opens_its_admin_view_to_the_key_it_prints(
    sim_factory, gateway_factory
):
    """`kvgate top --admin-key demo-admin`, as the demo's banner says, can read the fleet."""
    import aiohttp

    from kvgate.commands import demo

    sims = {name: await sim_factory(time_scale=0.01) for name in ("normal-a", "normal-b", "long")}
    gw = await gateway_factory(demo.gateway_config(demo.SimFleet(sims), 0))
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{gw.url}/admin/replicas") as resp:
            assert resp.status in (401, 403)
        headers = {"Authorization": f"Bearer {demo.DEMO_ADMIN_KEY}"}
        async with http.get(f"{gw.url}/admin/replicas", headers=headers) as resp:
            assert resp.status == 200
            assert len((await resp.json())["replicas"]) == 3
    assert f"--admin-key {demo.DEMO_ADMIN_KEY}" in demo.banner(gw.url, demo.SimFleet(sims))
