"""The simulator publishes vLLM's KV cache events (`--kv-events-config`): a block stored when
it fills, removed when evicted, all cleared on a reset; on vLLM's wire (topic, 8-byte
sequence number, msgpack batch), with its replay socket. tests/conformance decodes the same
stream with vLLM's own classes and compares the events with vLLM's scheduler step by step."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvgate.sim.config import SimConfig
from tests.plugins.kv_events import PROMPT, SIM, complete, replay, tokens


def events(batches: list[tuple[int, Any]]) -> list[dict[str, Any]]:
    return [event for _, (ts, batch, rank) in batches for event in batch]




async def test_a_prompt_is_published_as_the_blocks_it_filled_with_their_tokens(
    sim_factory, http
):
    replica = await sim_factory(**SIM)
    await complete(http, replica, PROMPT)
    ids = await tokens(http, replica, PROMPT)
    batches = await replay(replica)
    assert [seq for seq, _ in batches] == list(range(len(batches)))  # from 0, no gap
    ts, first, rank = batches[0][1]  # an array, as vLLM's: (ts, events, data_parallel_rank)
    assert isinstance(ts, float) and rank == 0  # vLLM's publisher sets its rank
    (stored,) = first
    full = len(ids) // 16
    assert stored["type"] == "BlockStored"
    assert stored["parent_block_hash"] is None and stored["block_size"] == 16
    assert stored["token_ids"] == ids[: full * 16] and len(stored["block_hashes"]) == full
    assert stored["medium"] == "GPU"

    await complete(http, replica, PROMPT)  # the same prompt again: its blocks are hits
    again = events(await replay(replica, start=len(batches)))
    assert not any(set(e.get("block_hashes", ())) & set(stored["block_hashes"]) for e in again)


async def test_evictions_and_a_reset_are_published(sim_factory, http):
    replica = await sim_factory(**SIM)
    for i in range(12):  # ~13 blocks each through a 63-block pool: cached blocks get evicted
        await complete(http, replica, f"topic {i} " + PROMPT)
    published = events(await replay(replica))
    stored = {h for e in published if e["type"] == "BlockStored" for h in e["block_hashes"]}
    removed = [h for e in published if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and set(removed) <= stored
    assert len(removed) == len(set(removed))  # each eviction once
    async with http.post(replica.url + "/reset_prefix_cache") as response:
        assert (await response.json()) == {"success": True}
    assert events(await replay(replica))[-1] == {"type": "AllBlocksCleared"}


async def test_the_live_stream_carries_the_same_batches_as_the_replay(sim_factory, http):
    replica = await sim_factory(**SIM)
    assert replica.kv_events_endpoints is not None
    socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    socket.connect(replica.kv_events_endpoints["endpoint"])
    try:
        live: list[tuple[int, bytes]] = []
        for i in range(40):  # a SUB socket joins late: publish until it hears
            await complete(http, replica, f"{i} " + PROMPT)
            if await socket.poll(50):
                break
        while await socket.poll(200):
            topic, seq, payload = await socket.recv_multipart()
            assert topic == b"kv"
            live.append((int.from_bytes(seq, "big"), payload))
        assert live
        numbers = [n for n, _ in live]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        replayed = dict(await replay(replica, start=numbers[0]))
        assert {n: msgspec.msgpack.decode(p) for n, p in live} == {
            n: replayed[n] for n in numbers}
    finally:
        socket.close()


async def test_a_restarted_engine_publishes_from_sequence_zero_on_the_same_ports(
    sim_factory, http
):
    replica = await sim_factory(**SIM)
    await complete(http, replica, PROMPT)
    endpoints = replica.kv_events_endpoints
    assert len(await replay(replica)) >= 1
    await replica.restart()
    assert replica.kv_events_endpoints == endpoints
    assert await replay(replica) == []  # a new engine: nothing buffered
    await complete(http, replica, PROMPT)
    assert (await replay(replica))[0][0] == 0


def test_the_flag_is_checked_as_vllm_checks_it():
    assert SimConfig().kv_events is None
    assert SimConfig(kv_events_config='{"enable_kv_cache_events": false}').kv_events is None
    assert SimConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "null"}'
                     ).kv_events is None  # fmt: skip
    with pytest.raises(ValueError, match="unknown field `endpiont`"):
        SimConfig(kv_events_config='{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="publisher 'kafka'"):
        SimConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "kafka"}')


async def test_a_data_parallel_rank_publishes_at_the_ports_plus_its_rank_and_says_which(
    sim_factory, http
):
    """vLLM's `--data-parallel-rank`: its engine's series carry `engine` = the rank, and its
    KV events go out at the configured ports + the rank, each batch marked with it."""
    from kvgate.fleet.scrape import parse_vllm_metrics
    from tests.plugins.processes import free_port

    port, replay_port = free_port(2), free_port(2)
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv", '
              f'"endpoint": "tcp://*:{port}", "replay_endpoint": "tcp://*:{replay_port}"}}')
    replica = await sim_factory(**{**SIM, "kv_events_config": config}, data_parallel_rank=1)
    assert replica.kv_events_endpoints == {
        "endpoint": f"tcp://127.0.0.1:{port + 1}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port + 1}",
    }
    await complete(http, replica, PROMPT)
    batches = await replay(replica)
    assert batches and all(rank == 1 for _, (_, _, rank) in batches)
    async with http.get(replica.url + "/metrics") as response:
        scrape = parse_vllm_metrics(await response.text(), 0.0)
    assert scrape.engines == (1,)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        SimConfig(data_parallel_rank=-1)
