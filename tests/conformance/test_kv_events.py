"""The simulator's KV events are vLLM's: its stream, read from its replay socket, decodes with
the classes of the installed `vllm` package (`vllm.distributed.kv_events`), so the format is
vLLM's and not a copy of kvgate's reading of it. (That the events say what vLLM's scheduler
says, step by step, is test_scheduler's: the harness compares them with every other field.)"""

from __future__ import annotations

import aiohttp
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from tests.sim.test_kv_events import PROMPT, SIM, complete, replay


async def test_the_simulators_stream_decodes_with_vllms_own_classes(sim_factory):
    replica = await sim_factory(**SIM)
    async with aiohttp.ClientSession() as http:
        for i in range(12):  # enough to evict in a 64-block pool
            await complete(http, replica, f"topic {i} " + PROMPT)
        async with http.post(replica.url + "/reset_prefix_cache") as response:
            assert (await response.json()) == {"success": True}
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    batches = [decode(payload) for _, payload in await replay(replica, raw=True)]
    kinds = {type(event) for batch in batches for event in batch.events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
    first = batches[0].events[0]
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
    assert len(first.token_ids) == first.block_size * len(first.block_hashes)
    assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for batch in batches)
