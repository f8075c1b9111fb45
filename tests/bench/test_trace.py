"""The production-trace workloads of the fleet benchmark: the shipped slice, the replay, the
prompts and answers it makes, and that an answer's length reaches the simulated replica
through every contender, unseen by kvgate as a length."""

from __future__ import annotations

import asyncio
import csv
import itertools
import statistics
from collections import Counter
from pathlib import Path

import aiohttp
import fleet  # bench/fleet.py
import pytest
from fleetbench import capacity, contenders, processes, trace, workloads
from fleetbench import fleet as sim_fleet
from fleetbench.prompts import ASSISTANT_PROMPT, EXTRACTION_PROMPT

from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.engine import Engine
from kvgate.sim.options import OUTPUT_TOKENS_HEADER
from kvgate.sim.text import PromptEncoder
from kvgate.tools.workload import WorkItem, run_workload
from tests.plugins.gateway import gateway_config

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces"
CITATION = (
    'Pratyush Patel, Esha Choukse, Chaojie Zhang, Aashaka Shah, Íñigo Goiri, Saeed Maleki, '
    'Ricardo Bianchini. "Splitwise: Efficient generative LLM inference using phase splitting", '
    "ISCA 2024."
)
SMALLEST_CHAT = 9  # the template around a one-word user message


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder(load_tiktoken())


def prompt_tokens(encoder: PromptEncoder, item: WorkItem) -> int:
    return len(encoder.encode_chat(item.body["messages"]))


def test_the_slice_ships_unchanged_with_its_attribution_and_licence():
    readme = (trace.SLICE.parent / "README.md").read_text()
    assert "Creative Commons Attribution 4.0 International" in readme and "CC-BY 4.0" in readme
    assert CITATION in " ".join(readme.split())
    assert trace.SLICE.name in readme
    lines = trace.SLICE.read_text().splitlines()
    assert lines[0] == "TIMESTAMP,ContextTokens,GeneratedTokens" and len(lines) == 2001
    original = SHARED_TRACE / "azure-llm-inference-2023-conv.csv"
    if original.exists():  # the rows the README names, byte for byte
        assert lines[1:] == original.read_text().splitlines()[2251:4251]
        assert "rows 2,251 to 4,250" in readme


def test_the_workload_is_the_same_for_a_seed_and_another_for_another_seed():
    for name in ("trace", "trace-mixed"):
        build = workloads.WORKLOADS[name].build
        assert build(3, 30.0, 8.0) == build(3, 30.0, 8.0)
        assert build(3, 30.0, 8.0) != build(4, 30.0, 8.0)


def test_replay_keeps_the_traces_inter_arrival_times_compressed_to_the_rate():
    rows = trace.load_slice()
    replayed = trace.replay(rows, 1990, 60.0, 20.0)  # past the slice's end: it loops
    assert [row for _, row in replayed[:12]] == [*rows[1990:], *rows[:2]]
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(replayed[:10])]
    original = [b.at_s - a.at_s for a, b in itertools.pairwise(rows[1990:2000])]
    factors = [g / o for g, o in zip(gaps, original, strict=True) if o > 0]
    assert max(factors) == pytest.approx(min(factors))  # one factor for every gap
    whole = trace.replay(rows, 0, 400.0, 5.0)  # the whole slice, once: its mean rate is as asked
    assert len(whole) == pytest.approx(2000, abs=2)


def test_every_prompt_is_its_rows_context_tokens_as_the_replicas_count_them(encoder):
    rows = Counter((max(r.context_tokens, SMALLEST_CHAT), r.generated_tokens)
                   for r in trace.load_slice())  # fmt: skip
    for name in ("trace", "trace-mixed"):
        items = workloads.WORKLOADS[name].build(0, 40.0, 12.0)
        made = Counter((prompt_tokens(encoder, i), int(i.headers[OUTPUT_TOKENS_HEADER]))
                       for i in items if i.tenant != "batch")  # fmt: skip
        assert made and made <= rows  # (prompt, answer) pairs of the slice's rows, as they are
        for item in items:
            assert (prompt_tokens(encoder, item), int(item.headers[OUTPUT_TOKENS_HEADER])) in rows
            first = item.body["messages"][0]
            system = EXTRACTION_PROMPT if item.tenant == "batch" else ASSISTANT_PROMPT
            # Every prompt long enough starts with its tenant's system prompt, unchanged.
            if prompt_tokens(encoder, item) > trace.template_tokens(system):
                assert first == {"role": "system", "content": system}
            else:
                assert first["role"] == "user"


def test_the_body_forces_no_length_and_max_tokens_is_as_each_variant_sets_it(encoder):
    fixed = workloads.WORKLOADS["trace"].build(1, 120.0, 10.0)
    mixed = workloads.WORKLOADS["trace-mixed"].build(1, 120.0, 10.0)
    for item in fixed + mixed:
        assert not {"ignore_eos", "min_tokens", "max_completion_tokens"} & set(item.body)
    assert {i.body["max_tokens"] for i in fixed} == {1024}
    shares = Counter(i.body.get("max_tokens") for i in mixed)
    assert set(shares) == {None, 2048, 4096}
    assert all(0.25 < n / len(mixed) < 0.42 for n in shares.values()), shares
    for item in mixed:  # long: what kvgate's long pool takes, and direct-rr sends long
        worst = prompt_tokens(encoder, item) + (item.body.get("max_tokens") or 0)
        assert (item.kind == "long") == (worst >= trace.LONG_POOL_MIN_TOKENS)


def test_a_few_requests_are_critical_and_the_bulk_tenant_bursts():
    items = workloads.WORKLOADS["trace"].build(2, 300.0, 10.0)
    assert len(items) == pytest.approx(3000, rel=0.1)
    tenants = Counter(i.tenant for i in items)
    assert set(tenants) == {"vip", "chat-app", "batch"}
    assert tenants["vip"] / (tenants["vip"] + tenants["chat-app"]) == pytest.approx(0.08, abs=0.02)
    assert tenants["batch"] / len(items) == pytest.approx(trace.BULK_SHARE, abs=0.03)
    # The bulk jobs come in bursts: a dozen or more within a second and a half, apart.
    arrivals = [i.at_s for i in items if i.tenant == "batch"]
    bursts: list[list[float]] = [[arrivals[0]]]
    for at in arrivals[1:]:
        (bursts[-1].append(at) if at - bursts[-1][0] <= trace.BURST_SPREAD_S
         else bursts.append([at]))  # fmt: skip
    assert len(bursts) >= 20
    assert all(len(b) >= trace.BURST[0] for b in bursts[:-1])  # the last may be cut short
    # The tenants' configs give them their classes.
    classes = {t["name"]: t["priority"] for t in contenders.TENANTS}
    assert (classes["vip"], classes["chat-app"], classes["batch"]) == (
        "critical", "standard", "sheddable")


def test_the_offline_capacity_estimate_ends_answers_where_the_trace_says(encoder):
    items = workloads.WORKLOADS["trace-mixed"].build(0, 10.0, 4.0)
    [replica, *_] = sim_fleet.replicas({n: 0 for n in sim_fleet.REPLICAS}, 1.0, {})
    engine = Engine(sim_fleet.sim_config(replica))
    capacity.submit(engine, items, encoder)
    while engine.has_unfinished_requests():
        engine.step(0.0)
    expected = sum(int(i.headers[OUTPUT_TOKENS_HEADER]) for i in items)
    assert engine.stats.generation_tokens == expected


TINY_FLEET = dict(num_gpu_blocks=2048, max_model_len=8192, time_scale=0.01,
                  output_len_dist="max")  # fmt: skip


def answer_items(encoder: PromptEncoder) -> list[WorkItem]:
    """Ten short trace requests, as the benchmark sends them."""
    items = [i for i in workloads.WORKLOADS["trace"].build(5, 20.0, 5.0)
             if prompt_tokens(encoder, i) < 1500][:10]  # fmt: skip
    return [WorkItem(n * 0.01, i.kind, i.tenant, i.body, i.headers) for n, i in enumerate(items)]


async def test_kvgate_passes_the_answer_length_on_to_the_replica(
    sim_factory, gateway_factory, encoder
):
    replica = await sim_factory(**TINY_FLEET)
    tenants = [{"name": t["name"], "priority": t["priority"]} for t in contenders.TENANTS]
    gw = await gateway_factory(gateway_config(
        [replica.url], tenants=tenants,
        auth={"mode": "trusted_header", "anonymous_tenant": "anonymous",
              "trusted_networks": ["127.0.0.1/32"]}))  # fmt: skip
    items = answer_items(encoder)
    results = await run_workload(gw.url, items, tenant_header="X-Tenant-Id", timeout_s=60)
    assert [r.status for r in results] == [200] * len(items)
    assert [r.output_tokens for r in results] == [
        int(i.headers[OUTPUT_TOKENS_HEADER]) for i in items]  # fmt: skip


@pytest.mark.skipif(contenders.vllm_router_command() is None,
                    reason="vllm-router is not installed (pip install -e '.[bench]')")  # fmt: skip
async def test_vllm_router_passes_the_answer_length_on_to_the_replica(
    sim_factory, encoder, tmp_path
):
    replica = await sim_factory(**TINY_FLEET)
    command = await asyncio.to_thread(contenders.vllm_router_command)  # a PATH search
    assert command is not None
    port = processes.free_port()
    url = f"http://127.0.0.1:{port}"
    async with processes.Children(tmp_path) as children, aiohttp.ClientSession() as http:
        children.start("vllm-router", [
            command, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", replica.url,
            "--policy", "round_robin", "--prometheus-port", str(processes.free_port()),
            "--worker-startup-check-interval", "1", "--log-level", "warning",
        ])  # fmt: skip
        await children.wait_ready(http, "vllm-router", url + "/health")
        items = answer_items(encoder)
        results = await run_workload(url, items, tenant_header=None, timeout_s=60)
    assert [r.output_tokens for r in results] == [
        int(i.headers[OUTPUT_TOKENS_HEADER]) for i in items]  # fmt: skip


def test_a_trace_run_takes_the_median_of_three_repeats_unless_told_otherwise():
    assert fleet.parse_args(["--workloads", "trace"]).repeats == 3
    assert fleet.parse_args(["--workloads", "trace-mixed", "realistic"]).repeats == 3
    assert fleet.parse_args(["--workloads", "realistic"]).repeats == 1
    args = fleet.parse_args(["--workloads", "trace", "--repeats", "2", "--loads", "1",
                             "--contenders", "direct-rr", "kvgate-predicted"])  # fmt: skip
    specs = fleet.plan(args, {"trace": 5.0})
    assert [(s.repeat, s.seed, s.contender.name) for s in specs] == [
        (0, 0, "direct-rr"), (0, 0, "kvgate-predicted"),
        (1, 1, "kvgate-predicted"), (1, 1, "direct-rr")]  # fmt: skip


def test_the_slice_is_long_enough_for_a_run_at_three_times_capacity():
    """A run at 3x replays each row of the slice at most once."""
    for name in ("trace", "trace-mixed"):
        workload = workloads.WORKLOADS[name]
        nominal = sim_fleet.replicas({n: 0 for n in sim_fleet.REPLICAS}, 1.0, {})
        rate = 3 * capacity.estimate(workload, nominal)["requests_per_s"]
        needed = (workload.warmup_s + workload.duration_s) * rate * (1 - trace.BULK_SHARE)
        assert needed < len(trace.load_slice())
    with trace.SLICE.open() as f:
        generated = [int(r["GeneratedTokens"]) for r in csv.DictReader(f)]
    assert max(generated) <= trace.FIXED_MAX_TOKENS  # 1,024 never cuts an answer short
    assert statistics.median(generated) < 200


def test_the_report_names_each_workload_and_where_a_traces_answer_lengths_come_from(tmp_path):
    from fleetbench import report

    names = ["realistic", "trace"]
    meta = {
        "command": "python bench/fleet.py --workloads realistic trace", "date": "2026-12-02 10:00",
        "profile": "full", "wall_s": 60.0,
        "machine": {"cpus": 2, "load_before": "0.1 0.1 0.1", "python": "3.11"},
        "settings": {"loads": [1.0], "repeats": 3, "ttft_timeout_s": 20.0, "timeout_s": 90.0,
                     "per_workload": {n: fleet.run_settings(fleet.parse_args([]), n)
                                      for n in names}},
        "fleet": {}, "contenders": {},
        "workloads": {n: workloads.WORKLOADS[n].describe for n in names},
        "output_lengths": {n: workloads.WORKLOADS[n].output_lengths for n in names},
    }  # fmt: skip
    plot = report.ROOT / "bench" / "results" / "trace" / "fleet-2026-12-02-goodput-trace.png"
    text = report.markdown(meta, {}, [], [plot, tmp_path / "elsewhere.png"])
    assert f"`trace` — {workloads.WORKLOADS['trace'].describe}" in text
    assert "max_tokens 1,024 on every request" in text
    assert "trace: each request's own" in text and OUTPUT_TOKENS_HEADER in text
    assert "realistic: output_len_dist lognormal" in text
    # Plots are linked from the repository's root, wherever the results were written.
    assert "(/bench/results/trace/fleet-2026-12-02-goodput-trace.png)" in text
    assert "(elsewhere.png)" in text
