"""What kvgate learns about each replica's KV capacity, and the real picture it exports."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.plugins.gateway import gateway_config
from tests.plugins.waiting import eventually


async def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels: str) -> float | None:
    for (sample, sample_labels), v in samples.items():
        if sample == name and set(labels.items()) <= sample_labels:
            return v
    return None


async def test_capacity_is_read_from_vllm_metrics_and_config_overrides_it(sim_factory, gateway_factory):
    seen = await sim_factory(num_gpu_blocks=512, max_model_len=2048, time_scale=0.01)
    pinned = await sim_factory(num_gpu_blocks=512, max_model_len=2048, time_scale=0.01)
    config = gateway_config([], pools={"default": {"replicas": [
        {"url": seen.url, "name": "seen"},
        {"url": pinned.url, "name": "pinned", "num_gpu_blocks": 100, "max_model_len": 1024},
    ]}})
    gw = await gateway_factory(config)
    replicas = {r.id: r for r in gw.gateway.registry}
    assert (replicas["seen"].num_gpu_blocks, replicas["seen"].block_size) == (512, 16)
    assert replicas["seen"].max_model_len("sim-model") == 2048
    assert replicas["pinned"].num_gpu_blocks == 100
    assert replicas["pinned"].max_model_len("sim-model") == 1024

    async def exported() -> bool:
        samples = await scrape(gw.url)
        return value(samples, "kvgate_replica_capacity_blocks", replica="seen") == 512

    await eventually(exported)
    samples = await scrape(gw.url)
    assert value(samples, "kvgate_replica_admissible_blocks", replica="seen") == int(512 * 0.9)
    assert value(samples, "kvgate_replica_capacity_blocks", replica="pinned") == 100
    assert value(samples, "kvgate_replica_healthy", replica="seen") == 1


async def test_a_replica_of_unknown_capacity_is_not_admitted_to(stub_factory, gateway_factory):
    stub = await stub_factory(num_gpu_blocks="None")  # vLLM reports "None" while starting
    gw = await gateway_factory(gateway_config([stub.url]), wait=False)
    await eventually(lambda: _true(any(r.healthy for r in gw.gateway.registry)))
    async with aiohttp.ClientSession() as session:
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as r:
            assert r.status == 503
            assert "capacity" in (await r.json())["error"]["message"]
    assert stub.received == []


async def test_reserved_written_and_vllm_usage_are_exported_while_a_stream_runs(
    sim_factory, gateway_factory
):
    replica = await sim_factory(num_gpu_blocks=512, max_model_len=2048, time_scale=1.0)
    gw = await gateway_factory(gateway_config([replica.url], discovery={"interval_s": 0.1}))
    (kv_replica,) = gw.gateway.registry
    body = {"model": "sim-model", "stream": True, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": "tell me a long story " * 20}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gw.url}/v1/chat/completions", json=body) as response,
    ):
        await response.content.readuntil(b"\n\n")

        async def all_three_lines() -> bool:
            s = await scrape(gw.url)
            return bool(
                (value(s, "kvgate_replica_reserved_blocks", replica=kv_replica.id) or 0) > 0
                and (value(s, "kvgate_replica_written_blocks", replica=kv_replica.id) or 0) > 0
                and (value(s, "kvgate_replica_vllm_kv_usage_ratio", replica=kv_replica.id) or 0) > 0
            )

        await eventually(all_three_lines)
        samples = await scrape(gw.url)
        reserved = value(samples, "kvgate_replica_reserved_blocks", replica=kv_replica.id)
        written = value(samples, "kvgate_replica_written_blocks", replica=kv_replica.id)
        assert reserved is not None and written is not None
        assert written < reserved  # the worst case is reserved up front, written grows
        headroom = value(samples, "kvgate_replica_headroom_requests", replica=kv_replica.id)
        assert headroom is not None and headroom >= 1
        await response.read()

    async def drained() -> bool:
        s = await scrape(gw.url)
        return value(s, "kvgate_replica_reserved_blocks", replica=kv_replica.id) == 0

    await eventually(drained)
    samples = await scrape(gw.url)
    assert (value(samples, "kvgate_reservation_efficiency_ratio_count", pool="default") or 0) == 1
    assert (value(samples, "kvgate_request_worst_case_blocks_count", pool="default") or 0) == 1


async def _true(x: bool) -> bool:
    return x


async def test_headroom_is_exported_and_shown_at_predicted_demand_and_at_the_worst_case(
    sim_factory, gateway_factory
):
    """Once answers are known, a request reserves its prompt and their expected length, not
    its whole max_tokens: the gauge and /admin/replicas tell both how many more such requests fit
    and how many more worst cases do, from the one fleet snapshot."""
    replica = await sim_factory(num_gpu_blocks=512, max_model_len=2048, time_scale=0.01)
    gw = await gateway_factory(gateway_config([replica.url]))
    (kv_replica,) = gw.gateway.registry
    body = {"model": "sim-model", "max_tokens": 640,
            "messages": [{"role": "user", "content": "a short question"}]}
    async with aiohttp.ClientSession() as session:
        async def answered() -> None:
            async with session.post(f"{gw.url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()

        await asyncio.gather(*(answered() for _ in range(16)))  # teach kvgate their length
        await answered()  # reserves its predicted length
        async with session.get(f"{gw.url}/admin/replicas") as r:
            (shown,) = (await r.json())["replicas"]
    headroom = shown["headroom_requests"]
    assert set(headroom) == {"predicted", "worst_case"}
    assert headroom["worst_case"] == int(512 * 0.9) // 41  # 640 + the prompt: 41 blocks
    # prompt + the answers' expected length, well short of max_tokens
    assert headroom["predicted"] > headroom["worst_case"]

    async def exported() -> bool:
        s = await scrape(gw.url)
        return all(
            value(s, "kvgate_replica_headroom_requests", replica=kv_replica.id, basis=basis)
            == headroom[basis] for basis in headroom
        )

    await eventually(exported)
