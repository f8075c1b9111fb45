"""Precise prefix routing through kvgate, end to end: two simulated replicas publish their KV
cache events, kvgate knows a chat's token ids exactly (the simulator's ChatML template and
markers), and a chat goes where its document is cached — not where its system prompt's
fingerprint points — until the replica evicts it."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from kvgate.fleet.block_index import block_keys
from kvgate.sim.server import SimReplica
from tests.plugins.gateway import gateway_config
from tests.plugins.kv_events import EVENTS, SIM_CHATML, document_chat
from tests.plugins.waiting import eventually

SIM = {"time_scale": 0.001, "num_gpu_blocks": 512, "max_model_len": 2048,
       "kv_events_config": EVENTS}
chat = document_chat


def config(replicas: list[SimReplica]) -> Any:
    entries = []
    for i, replica in enumerate(replicas):
        assert replica.kv_events_endpoints is not None
        entries.append({"url": replica.url, "name": "ab"[i], "kv_events": replica.kv_events_endpoints})
    return gateway_config(
        [], pools={"default": {"replicas": entries, "kv_events": {}}},
        models=[SIM_CHATML],
    )


async def served_on(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()
        return response.headers["X-Kvgate-Replica"]


async def test_a_chat_goes_where_its_document_is_cached_until_that_replica_evicts_it(
    sim_factory, gateway_factory
):
    replicas = [await sim_factory(**SIM), await sim_factory(**SIM)]
    gw = await gateway_factory(config(replicas))
    events = gw.gateway.kv_events
    by_name = dict(zip("ab", replicas, strict=True))
    async with aiohttp.ClientSession() as http:
        # where the shared system prompt's fingerprint sends a new document
        first = await served_on(http, gw.url, chat(0, "What is clause 3?"))
        other = "b" if first == "a" else "a"

        warm = iter(range(100, 10_000))

        async def listening() -> bool:
            for name in "ab":  # a replica's first batch starts its index (a SUB joins late)
                if events.index(name) is None:  # a new prompt each time: new blocks, a batch
                    async with http.post(f"{by_name[name].url}/v1/chat/completions",
                                         json=chat(next(warm), "warm up")) as r:  # fmt: skip
                        await r.read()
                    await asyncio.sleep(0.05)
            return all(events.index(name) is not None for name in "ab")

        await eventually(listening, timeout_s=10, what="both indexes")
        # document 1 is read on the other replica first (directly: another gateway, say)
        async with http.post(f"{by_name[other].url}/v1/chat/completions",
                             json=chat(1, "Summarize.")) as r:  # fmt: skip
            assert r.status == 200
            await r.read()

        counter = gw.gateway.runtime.catalog.counter("sim-model")
        ids = (await counter.count_chat(chat(1, "Summarize.")["messages"])).token_ids
        assert ids is not None  # kvgate knows the chat's token ids exactly

        async def cached() -> bool:  # document 1's blocks, not only the warm-ups'
            index = events.index(other)
            return index is not None and index.leading(block_keys(ids, 16)) >= 20

        await eventually(cached, timeout_s=5, what="document 1 in the index")
        for question in ("What is clause 7?", "Who signs?", "When does it end?"):
            assert await served_on(http, gw.url, chat(1, question)) == other
        # the other replica drops its cache: the next chat follows the fingerprint again
        async with http.post(f"{by_name[other].url}/reset_prefix_cache") as r:
            assert (await r.json()) == {"success": True}

        async def cleared() -> bool:
            index = events.index(other)
            return index is not None and len(index) == 0

        await eventually(cleared, timeout_s=5, what="the eviction seen")
        assert await served_on(http, gw.url, chat(1, "And clause 9?")) == first
        async with http.get(f"{gw.url}/admin/replicas") as r:
            listing = (await r.json())["replicas"]
        assert {v["id"]: v["prefix_source"] for v in listing} == {"a": "kv_events",
                                                                 "b": "kv_events"}
        assert all(v["kv_events"]["subscribed"] for v in listing)
    await asyncio.sleep(0)
