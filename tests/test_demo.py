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


async def test_the_readme_snippet_works_against_the_demo_fleet():
    """What the demo's banner tells a new user to run, with its api_key, completes."""
    import openai

    from kvgate.commands import demo
    from kvgate.tokens import load_tiktoken

    fleet = await demo.start_fleet(load_tiktoken(), time_scale=0.01)
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
        await demo.stop_fleet(fleet)
