"""Reading a replica's /metrics: kvgate parses only the families it reads, and reads them as
prometheus_client's parser reads the whole exposition; reads on demand are spaced."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvgate.config import ReplicaConfig
from kvgate.fleet.replicas import Replica
from kvgate.fleet.scrape import READ_GAP_S, metrics_read_after, parse_vllm_metrics, read_lines
from tests.plugins.gateway import serve_app
from tests.plugins.sim import SimFactory
from tests.sim.helpers import FAST

# Scrape field -> the family it sums, as the parser names it
SUMMED = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions",
    "prefix_queries": "vllm:prefix_cache_queries",
    "prefix_hits": "vllm:prefix_cache_hits",
    "generation_tokens": "vllm:generation_tokens",
}


def whole(text: str, family: str) -> list[float]:
    """The family's sample values, read by prometheus_client from the whole exposition."""
    return [
        s.value
        for f in text_string_to_metric_families(text) if f.name == family
        for s in f.samples if not s.name.endswith("_created")
    ]  # fmt: skip


async def test_a_replicas_exposition_reads_as_the_whole_parse_reads_it(
    sim_factory: SimFactory,
) -> None:
    replica = await sim_factory(**FAST)
    async with aiohttp.ClientSession() as http:
        for n in range(5):
            body = {"messages": [{"role": "user", "content": f"hi {n} " * 20}], "max_tokens": 7}
            async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                await response.read()
        async with http.get(replica.url + "/metrics") as response:
            text = await response.text()
    scrape = parse_vllm_metrics(text, at=1.0)
    for field, family in SUMMED.items():
        assert getattr(scrape, field) == sum(whole(text, family)), field
    assert scrape.generation_tokens == 35 and scrape.prefix_queries > 0  # the figures are live
    assert scrape.kv_usage == whole(text, "vllm:kv_cache_usage_perc")[0]
    assert (scrape.num_gpu_blocks, scrape.block_size) == (FAST["num_gpu_blocks"], 16)
    # the engine's start: when its generation counter began
    started = [s.value for f in text_string_to_metric_families(text)
               if f.name == "vllm:generation_tokens_created" for s in f.samples]  # fmt: skip
    assert scrape.started_at == max(started) > 0
    # what is left for the parser: the read families only, none of the histograms
    kept = {f.name for f in text_string_to_metric_families(read_lines(text))}
    assert kept == {*SUMMED.values(), "vllm:kv_cache_usage_perc", "vllm:cache_config_info",
                    "vllm:admission_rejections", "vllm:generation_tokens_created",
                    } & {f.name for f in text_string_to_metric_families(text)}  # fmt: skip
    assert len(read_lines(text)) < len(text) / 5


ENGINES = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage (an older vLLM's name).
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0"} 0.25
vllm:gpu_cache_usage_perc{engine="1"} 0.75
  # TYPE vllm:num_requests_running gauge
  vllm:num_requests_running{engine="0"} 3 1700000000000
vllm:num_requests_running{engine="1"} 4
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0"} 2
vllm:num_preemptions_total{engine="1"} 5
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0"} 1.7e9
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="220"} 1
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="220"} 1
"""  # each engine's series carries the server's config: its blocks summed over the engines


def test_engines_sum_older_names_alias_and_timestamps_and_indents_are_read() -> None:
    scrape = parse_vllm_metrics(ENGINES, at=2.0)
    assert scrape.kv_usage == 0.5  # the mean over engines
    assert scrape.running == 7 and scrape.preemptions == 7  # _created is not a count
    assert (scrape.num_gpu_blocks, scrape.block_size) == (220, 32)
    assert scrape.waiting is None and scrape.at == 2.0
    assert scrape.engines == (0, 1)  # the data-parallel ranks, for their KV events


def test_a_family_kvgate_does_not_read_cannot_make_the_scrape_unreadable() -> None:
    broken = "# TYPE vllm:e2e_request_latency_seconds histogram\nvllm:e2e_request_latency_seconds_bucket{le=\"1\" 3\n"
    scrape = parse_vllm_metrics(broken + ENGINES, at=0.0)
    assert scrape.running == 7
    with pytest.raises(ValueError):  # one it reads still can: the read is refused, not guessed
        parse_vllm_metrics(ENGINES + 'vllm:num_requests_waiting{engine="0" 3\n', at=0.0)


async def test_reads_on_demand_are_spaced_and_each_covers_the_end_it_was_asked_for() -> None:
    """Requests that end one after another share reads of /metrics spaced READ_GAP_S apart
    (a replica answering fast is not read once per answer), and each waits for a read sent
    after its own end, so that the figures it is charged by cover it."""
    sent: list[float] = []

    async def metrics(request: web.Request) -> web.Response:
        sent.append(time.monotonic())
        return web.Response(text=f"vllm:num_requests_running {len(sent)}\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, url = await serve_app(app)
    replica = Replica(ReplicaConfig(url=url), "pool")
    ends = 40
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        stack.push_async_callback(runner.cleanup)
        waits = []
        for _ in range(ends):  # one end every 20 ms: 0.8 s of them
            moment = time.monotonic()
            waits.append((moment, metrics_read_after(http, replica, moment, timeout_s=1.0)))
            await asyncio.sleep(0.02)
        for moment, read in waits:
            assert await asyncio.shield(read)
            # a read was sent after this end, and had come back when the wait was over
            assert any(moment <= at for at in sent)
    assert replica.scrape is not None and replica.scrape.running == len(sent)  # the last read
    assert 2 <= len(sent) <= 1 + math.ceil(0.8 / READ_GAP_S) + 1, sent
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert min(gaps) >= READ_GAP_S * 0.9, gaps  # the timer's own slack aside
