"""The ledger against what a replica really needs when many chats read a few long documents:
kvgate knows the chats' token ids exactly (the simulator's ChatML template), so each
document's blocks are reserved once per replica, as vLLM stores them.

The replica's need is what the simulator itself holds plus what its running requests may
still allocate (each one's worst case, less the blocks it has): a worst-case ledger should
show exactly that. The error is |ledger − need| ÷ the replica's blocks, sampled while every
request kvgate has sent there runs. Before this credit, each chat reserved its whole
document: the ledger over-stated the need by 34% of the replica on average (59% at most),
and only part of the 12 chats were let in at once. The written view (what kvgate believes
its requests have written there) is held to the replica's held blocks the same way."""

from __future__ import annotations

import asyncio
import math
import statistics
from typing import Any

import aiohttp

from kvgate.sim.server import SimReplica
from tests.plugins.gateway import gateway_config
from tests.plugins.kv_events import EVENTS, SIM_CHATML, document_chat

SIM = {"time_scale": 0.3, "num_gpu_blocks": 1024, "max_model_len": 4096, "max_num_seqs": 64,
       "kv_events_config": EVENTS}
N_CHATS, DOCUMENTS, MAX_TOKENS = 12, 2, 160


def chat(document: int, question: int) -> dict[str, Any]:  # ~70 blocks
    return document_chat(document, question, 300, max_tokens=MAX_TOKENS, ignore_eos=True)


def config(sim: SimReplica) -> Any:
    return gateway_config(
        [], admission={"mode": "worst_case"},
        pools={"default": {"replicas": [{"url": sim.url, "name": "a",
                                         "kv_events": sim.kv_events_endpoints}],
                           "kv_events": {}}},
        models=[SIM_CHATML],
    )


async def test_a_worst_case_ledger_shows_what_the_replica_needs_when_chats_share_documents(
    sim_factory, gateway_factory
):
    sim = await sim_factory(**SIM)
    gw = await gateway_factory(config(sim))
    admission = gw.gateway.admission
    size = sim.engine.block_size
    (replica,) = gw.gateway.registry
    errors: list[float] = []
    written: list[float] = []  # |the written view − held| ÷ blocks
    together = 0  # the most chats running at once
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def one(body: dict[str, Any]) -> None:
            async with http.post(f"{gw.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()

        await one(chat(DOCUMENTS, 0))  # the replica's token rate is known after one
        tasks = [asyncio.create_task(one(chat(i % DOCUMENTS, i))) for i in range(N_CHATS)]
        while not all(task.done() for task in tasks):
            engine = sim.engine
            # every chat kvgate has sent is running there (none still in vLLM's queue)
            if len(engine.running) == len(replica.inflight) >= 2 and not engine.waiting:
                together = max(together, len(engine.running))
                held = engine.pool.num_gpu_blocks - 1 - engine.pool.num_free_blocks
                to_come = sum(
                    max(0, math.ceil((r.num_prompt_tokens + r.max_tokens) / size) - len(r.blocks))
                    for r in engine.running
                )
                reserved = admission.reserved.get("a", 0)
                errors.append(abs(reserved - (held + to_come)) / engine.pool.num_gpu_blocks)
                written.append(abs(replica.written_blocks() - held) / engine.pool.num_gpu_blocks)
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
    assert len(errors) >= 5
    print(f"ledger vs need: mean {statistics.mean(errors):.2%}, max {max(errors):.2%} "
          f"over {len(errors)} samples; written view vs held: mean {statistics.mean(written):.2%}")
    assert max(errors) <= 0.02
    assert statistics.mean(written) <= 0.02
    assert together == N_CHATS  # all fit at once: 2 documents of 70 blocks, 12 answers of 10
    assert sum(admission.reserved.values()) == 0
