"""`/metrics` in vLLM's names, and what an overloaded replica really does."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvgate.sim.server import SimReplica
from tests.plugins.sim import SimFactory
from tests.plugins.waiting import eventually
from tests.sim.helpers import scrape, value

VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}


async def chat(
    http: aiohttp.ClientSession, replica: SimReplica, content: str, max_tokens: int
) -> None:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        await response.read()


async def test_metrics_parse_and_carry_vllms_names_types_and_labels(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(
        time_scale=0.001, num_gpu_blocks=300, max_model_len=1024, served_model_name="m1"
    )
    await chat(http, replica, "hello there", 3)
    families = await scrape(http, replica)
    for name, kind in VLLM_METRICS.items():
        assert families[name].type == kind, name
    for name in VLLM_METRICS:
        if name == "vllm:cache_config_info":
            continue
        for sample in families[name].samples:
            assert sample.labels["model_name"] == "m1" and sample.labels["engine"] == "0"
    (info,) = families["vllm:cache_config_info"].samples
    assert "model_name" not in info.labels
    assert info.labels["num_gpu_blocks"] == "300" and info.labels["block_size"] == "16"
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["engine"] == "0"
    assert value(families, "vllm:request_success", "_total", finished_reason="length") == 1
    assert value(families, "vllm:generation_tokens", "_total") == 3
    assert value(families, "vllm:prompt_tokens", "_total") > 0
    assert value(families, "vllm:time_to_first_token_seconds", "_count") == 1
    assert value(families, "vllm:inter_token_latency_seconds", "_count") == 2
    assert value(families, "vllm:request_params_max_tokens", "_sum") == 3
    assert value(families, "vllm:kv_cache_usage_perc") == 0.0


async def test_an_overloaded_replica_really_queues_and_preempts(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    # 63 usable blocks (1008 tokens); 16 requests of ~120 prompt tokens growing to ~420.
    replica = await sim_factory(time_scale=0.005, num_gpu_blocks=64, max_model_len=512)
    load = [
        asyncio.ensure_future(chat(http, replica, f"request {i}: " + "tok " * 100, 300))
        for i in range(16)
    ]
    max_waiting = 0.0
    while not all(task.done() for task in load):
        families = await scrape(http, replica)
        max_waiting = max(max_waiting, value(families, "vllm:num_requests_waiting"))
        await asyncio.sleep(0.01)
    await asyncio.gather(*load)
    families = await scrape(http, replica)
    assert max_waiting > 0
    assert value(families, "vllm:num_preemptions", "_total") > 0
    assert value(families, "vllm:request_success", "_total", finished_reason="length") == 16
    assert value(families, "vllm:num_requests_running") == 0


async def test_client_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(time_scale=0.5, num_gpu_blocks=256, max_model_len=2048)
    body = {"messages": [{"role": "user", "content": "x " * 200}], "max_tokens": 1000,
            "stream": True}  # fmt: skip
    response = await http.post(replica.url + "/v1/chat/completions", json=body)
    await response.content.readuntil(b"\n\n")  # the role chunk
    await response.content.readuntil(b"\n\n")  # a first token: blocks are held
    assert replica.engine.pool.num_free_blocks < 255
    response.close()
    await eventually(lambda: not replica.engine.has_unfinished_requests())
    assert replica.engine.pool.num_free_blocks == 255
    assert replica.engine.stats.aborted == 1
    families = await scrape(http, replica)
    assert value(families, "vllm:request_success", "_total", finished_reason="abort") == 1


async def test_client_disconnect_while_waiting_for_a_full_response_aborts_it(
    sim_factory: SimFactory,
) -> None:
    replica = await sim_factory(time_scale=0.5, num_gpu_blocks=256, max_model_len=2048)
    body = {"messages": [{"role": "user", "content": "y " * 200}], "max_tokens": 1000}
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(
            session.post(replica.url + "/v1/chat/completions", json=body)
        )
        await eventually(lambda: replica.engine.stats.steps > 0)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    await eventually(lambda: not replica.engine.has_unfinished_requests())
    assert replica.engine.pool.num_free_blocks == 255

