"""The simulator's KV events are vLLM's: its stream, read from its replay socket, decodes with
the classes of the installed `vllm` package (`vllm.distributed.kv_events`), so the format is
vLLM's and not a copy of kvgate's reading of it. (That the events say what vLLM's scheduler
says, step by step, is test_scheduler's: the harness compares them with every other field.)
kvgate's own computation of vLLM's block hashes is checked against vLLM's functions here."""

from __future__ import annotations

import aiohttp
import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from kvgate.fleet.engine_hash import DEFAULT_SEED, EngineHashes
from tests.plugins.kv_events import PROMPT, SIM, complete, replay, tokens


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


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", [None, "4242"])
def test_kvgates_block_hashes_are_vllms_own(algorithm, seed, monkeypatch):
    """kvgate's engine hashes (`kvgate.fleet.engine_hash`) are what vLLM's own functions
    compute for a prompt's blocks, under vLLM's default seed and under PYTHONHASHSEED, and
    as its KV events publish them (the low 64 bits as an int, or the digest)."""
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    function = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(function)
    ours = EngineHashes(algorithm, seed or DEFAULT_SEED)
    tokens = [(i * 7919) % 32000 for i in range(16 * 5 + 3)]
    theirs, parent = [], None
    for start in range(0, len(tokens) - 15, 16):
        parent = kv_cache_utils.hash_block_tokens(function, parent, tokens[start : start + 16])
        theirs.append(parent)
    assert [ours.chain(None, tokens[:16])] == theirs[:1]
    assert ours.block_hashes(tokens, 16) == [kv_cache_utils.maybe_convert_block_hash(h)
                                             for h in theirs]  # fmt: skip
    assert ours.block_hashes(tokens, 16, ints=False) == [bytes(h) for h in theirs]


async def test_the_simulator_publishes_vllms_own_hashes_for_a_prompt(sim_factory):
    """The simulator hashes blocks as vLLM does by default, so a gateway computes them."""
    replica = await sim_factory(**SIM)
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
    async with aiohttp.ClientSession() as http:
        await complete(http, replica, PROMPT)
        ids = await tokens(http, replica, PROMPT)
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    (first, *_) = [e for _, p in await replay(replica, raw=True) for e in decode(p).events]
    expected, parent = [], None
    for start in range(0, len(first.token_ids), first.block_size):
        parent = kv_cache_utils.hash_block_tokens(
            get_hash_fn_by_name("sha256"), parent, ids[start : start + first.block_size])
        expected.append(kv_cache_utils.maybe_convert_block_hash(parent))
    assert first.block_hashes == expected
