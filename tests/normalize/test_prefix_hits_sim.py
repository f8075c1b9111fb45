"""Normalization on a simulated fleet: the replica's own prefix-cache counters say what it buys.

The same noisy workload (a timestamp in the system prompt's first line, CRLF half the time,
random trailing blanks, tool JSON in random key order) goes through kvgate with normalization
off, and on (with timestamps relocated); the same prompts sent clean are the reference. The hit
rate is read from the simulator's /metrics, vllm:prefix_cache_hits_total ÷
vllm:prefix_cache_queries_total, as a Prometheus server would.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.tools.noisy import clean_chats, noisy_chats
from tests.plugins.gateway import gateway_config

REQUESTS = 24
SIM = dict(num_gpu_blocks=2048, max_model_len=4096, time_scale=0.01)
ON = {"rules": {"relocate_dynamic": True}, "relocate": {"patterns": ["timestamp"]}}


async def replica_hit_rate(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
                found[sample.name] = sample.value
    return found["vllm:prefix_cache_hits_total"] / found["vllm:prefix_cache_queries_total"]


async def hit_rate_through_kvgate(sim_factory, gateway_factory, bodies: list[dict[str, Any]],
                                  normalization: dict[str, Any]) -> float:  # fmt: skip
    replica = await sim_factory(**SIM)
    gw = await gateway_factory(gateway_config([replica.url], normalization=normalization))
    async with aiohttp.ClientSession() as session:
        for body in bodies:  # one at a time: each request finds the previous one's blocks
            async with session.post(f"{gw.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
    return await replica_hit_rate(replica.url)


async def test_normalization_recovers_the_clean_hit_rate_on_a_noisy_workload(
    sim_factory, gateway_factory
):
    noisy = noisy_chats(REQUESTS, seed=1)
    off = await hit_rate_through_kvgate(sim_factory, gateway_factory, noisy, {"enabled": False})
    on = await hit_rate_through_kvgate(sim_factory, gateway_factory, noisy, ON)
    clean = await hit_rate_through_kvgate(
        sim_factory, gateway_factory, clean_chats(REQUESTS), {"enabled": False}
    )
    print(f"prefix-cache hit rate: off {off:.3f}, on {on:.3f}, clean {clean:.3f}")
    assert clean > 0.8
    assert on >= 0.9 * clean
    assert off <= clean / 3


async def test_safe_rules_alone_recover_the_hit_rate_when_the_prompt_has_no_timestamp(
    sim_factory, gateway_factory
):
    """Trailing blanks, CRLF and tool key order need no opt-in: the defaults handle them."""
    noisy = noisy_chats(REQUESTS, seed=2)
    for body in noisy:
        system = body["messages"][0]
        system["content"] = system["content"].split("\n", 1)[1]  # the timestamp line dropped
    on = await hit_rate_through_kvgate(sim_factory, gateway_factory, noisy, {})
    clean = await hit_rate_through_kvgate(
        sim_factory, gateway_factory, clean_chats(REQUESTS), {}
    )
    assert on >= 0.9 * clean
