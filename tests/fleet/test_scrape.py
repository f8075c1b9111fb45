"""Reading a replica's /metrics: kvgate parses only the families it reads, and reads them as
prometheus_client's parser reads the whole exposition."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.fleet.scrape import parse_vllm_metrics, read_lines
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
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="120"} 1
"""


def test_engines_sum_older_names_alias_and_timestamps_and_indents_are_read() -> None:
    scrape = parse_vllm_metrics(ENGINES, at=2.0)
    assert scrape.kv_usage == 0.5  # the mean over engines
    assert scrape.running == 7 and scrape.preemptions == 7  # _created is not a count
    assert (scrape.num_gpu_blocks, scrape.block_size) == (220, 32)
    assert scrape.waiting is None and scrape.at == 2.0


def test_a_family_kvgate_does_not_read_cannot_make_the_scrape_unreadable() -> None:
    broken = "# TYPE vllm:e2e_request_latency_seconds histogram\nvllm:e2e_request_latency_seconds_bucket{le=\"1\" 3\n"
    scrape = parse_vllm_metrics(broken + ENGINES, at=0.0)
    assert scrape.running == 7
    with pytest.raises(ValueError):  # one it reads still can: the read is refused, not guessed
        parse_vllm_metrics(ENGINES + 'vllm:num_requests_waiting{engine="0" 3\n', at=0.0)
