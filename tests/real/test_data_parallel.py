"""A real vLLM running two data-parallel engines behind one server (`--data-parallel-size 2`:
an engine, a KV cache and a KV events publisher per rank, at the ports + the rank). kvgate
counts the server's blocks once, follows both ranks' events, and pins a request to the engine
that holds its prompt (vLLM's `X-data-parallel-rank`): that engine's own prefix-cache hits
show it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.fleet.block_index import block_keys
from kvgate.tools.tiny_model import MODEL_NAME
from kvgate.tools.vllm_cpu import Engine, EngineSpec
from tests.plugins import client
from tests.plugins.processes import free_port
from tests.plugins.waiting import eventually
from tests.real.conftest import document_chat as chat
from tests.real.conftest import real_config, tiny_model, wait_idle

pytestmark = pytest.mark.timeout(300)
BLOCKS = 256  # per engine


@pytest.fixture(scope="module")
def dp_engine() -> Iterator[Engine]:
    model = tiny_model()
    spec = EngineSpec(num_blocks=BLOCKS, kv_events=True, extra=("--data-parallel-size", "2"))
    # rank 1 publishes at the ports + 1: both free
    engine = Engine(spec, model, events_port=free_port(2), replay_port=free_port(2))
    engine.start()
    try:
        asyncio.run(engine.wait_ready())
        yield engine
    finally:
        engine.stop()


async def hits(http: aiohttp.ClientSession, engine: Engine) -> dict[str, float]:
    """Each engine's prefix-cache hits (tokens), by its `engine` label."""
    async with http.get(f"{engine.url}/metrics") as response:
        text = await response.text()
    return {sample.labels["engine"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "vllm:prefix_cache_hits"
            for sample in family.samples if sample.name.endswith("_total")}  # fmt: skip


async def test_two_ranks_behind_one_server_are_counted_once_followed_each_and_pinned(
    dp_engine, gateway_factory
):
    gw = await gateway_factory(real_config({"dp": dp_engine}, ["dp"]))
    events, (replica,) = gw.gateway.kv_events, list(gw.gateway.registry)
    counter = gw.gateway.runtime.catalog.counter(MODEL_NAME)
    # the server's num_gpu_blocks is already its engines' sum, on each engine's series
    await eventually(lambda: replica.num_gpu_blocks is not None, timeout_s=10, what="a scrape")
    assert replica.num_gpu_blocks == 2 * BLOCKS
    warm = iter(range(1000, 2000))
    async with aiohttp.ClientSession() as http:

        async def post(url: str, body: dict[str, Any], engine: int | None = None) -> None:
            headers = {} if engine is None else {"X-data-parallel-rank": str(engine)}
            status, _, raw = await client.post(f"{url}/v1/chat/completions", body, http=http,
                                               headers=headers)
            assert status == 200, raw

        async def listening() -> bool:  # each rank's SUB socket joins late: prompts until heard
            for stream, engine in (("dp", 0), ("dp/dp1", 1)):
                if events.index(stream) is None:
                    await post(dp_engine.url, chat(next(warm), "warm up"), engine)
            return events.index("dp") is not None and events.index("dp/dp1") is not None

        await eventually(listening, timeout_s=30, interval_s=0.2, what="both ranks' events")

        async def held_by(stream: str, document: int) -> bool:
            ids = (await counter.count_chat(chat(document, "x")["messages"])).token_ids
            index = events.index(stream)
            assert ids is not None and index is not None
            return index.leading(block_keys(ids, 32)) >= 25

        # document 1 is read on engine 1 directly, document 2 on engine 0
        for document, engine, stream in ((1, 1, "dp/dp1"), (2, 0, "dp")):
            await post(dp_engine.url, chat(document, "Summarize."), engine)
            await eventually(lambda d=document, s=stream: held_by(s, d), timeout_s=15,
                             what=f"document {document} in {stream}'s index")  # fmt: skip
        for document, engine in ((1, "1"), (2, "0")):
            before = await hits(http, dp_engine)
            await post(gw.url, chat(document, "What is clause 7?"))
            after = await hits(http, dp_engine)
            gained = {label: after[label] - before.get(label, 0.0) for label in after}
            # the document's ~30 blocks of 32 tokens hit where it was pinned, not elsewhere
            assert gained[engine] >= 25 * 32 and sum(gained.values()) == gained[engine], gained
        async with http.get(f"{gw.url}/admin/replicas") as response:
            (listing,) = (await response.json())["replicas"]
        ranks = listing["kv_events"]["ranks"]
        assert set(ranks) == {"0", "1"} and all(r["subscribed"] for r in ranks.values())
    await wait_idle(dp_engine)
