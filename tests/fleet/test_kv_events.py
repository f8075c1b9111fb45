"""The KV events subscriber and its block index: decoding both encodings, keys recomputed from
token ids, and recovery — a gap replayed, an engine restart (sequence numbers from 0 again)
reset and replayed, a kvgate restart replayed from 0, an unhealthy or silent replica dropped —
against the simulator's real ZMQ sockets."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import msgspec
import pytest

from kvgate.config import KvEventsConfig, KvEventsEndpoints, ReplicaConfig, parse_config
from kvgate.fleet.block_index import ROOT_KEY, BlockIndex, LazyKeys, block_keys, chain_key
from kvgate.fleet.kv_events import KvEvents, endpoints_of
from kvgate.fleet.kv_subscriber import ReplicaEvents, Sequencer, Subscriber
from kvgate.fleet.kv_wire import Event, decode_batch
from kvgate.fleet.replicas import Replica
from kvgate.fleet.scrape import Scrape
from kvgate.metrics import Metrics
from kvgate.sim import kv_events as sim_events
from kvgate.sim.server import SimReplica
from tests.plugins.kv_events import PROMPT, SIM, caught_up, complete, joined, replay, tokens
from tests.plugins.waiting import eventually

SETTINGS = KvEventsConfig(replay_timeout_s=2.0)


def stored(hashes: list[int], tokens_: list[int], parent: int | None = None) -> Event:
    return Event("stored", tuple(hashes), parent, tuple(tokens_), 2)


# --------------------------------------------------------------------------- decoding


def test_a_batch_decodes_with_its_events_as_maps_or_as_arrays():
    as_maps = msgspec.msgpack.encode(sim_events.KVEventBatch(ts=5.0, events=[
        sim_events.BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                               block_size=2, lora_id=None, medium="GPU", lora_name=None),
        sim_events.BlockRemoved(block_hashes=[8], medium="GPU"),
        sim_events.AllBlocksCleared(),
    ]))  # fmt: skip
    # earlier producers: every event an array led by its tag, the batch a map
    as_arrays = msgspec.msgpack.encode({"ts": 5.0, "events": [
        ["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU"],
        ["BlockRemoved", [8], "GPU"],
        ["AllBlocksCleared"],
    ]})  # fmt: skip
    expected = [Event("stored", (7, 8), None, (1, 2, 3, 4), 2), Event("removed", (8,)),
                Event("cleared")]
    for payload in (as_maps, as_arrays):
        batch = decode_batch(payload)
        assert (batch.ts, batch.events, batch.unknown) == (5.0, expected, 0)


def test_unknown_event_kinds_are_skipped_and_malformed_batches_refused():
    batch = decode_batch(msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "x": 1}]]))
    assert (batch.events, batch.unknown) == ([], 1)
    for bad in (b"\xc1", msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode([1.0, [7]]),
                msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2, 3], 2]]])):
        with pytest.raises(ValueError):
            decode_batch(bad)


# --------------------------------------------------------------------------- the index


def test_blocks_are_keyed_by_their_tokens_chained_from_the_parent_whatever_the_hashes():
    index = BlockIndex(capacity=100)
    index.apply(stored([101, 102], [1, 2, 3, 4]))
    index.apply(stored([103], [5, 6], parent=102))  # the next block of the same prompt
    request = block_keys([1, 2, 3, 4, 5, 6, 9, 9], 2)
    assert index.leading(request) == 3  # its first three blocks are held
    assert index.leading(block_keys([1, 2, 9, 9, 5, 6], 2)) == 1  # one token differs
    other = BlockIndex(capacity=100)  # another engine, other hashes: the same keys
    other.apply(stored([9001, 9002, 9003], [1, 2, 3, 4, 5, 6]))
    assert other.keys() == index.keys()


def test_a_removed_block_stops_counting_and_a_hash_stored_twice_is_removed_twice():
    index = BlockIndex(capacity=100)
    index.apply(stored([101, 102], [1, 2, 3, 4]))
    index.apply(stored([101], [1, 2]))  # a second block with the same hash
    index.apply(Event("removed", (101,)))
    assert index.leading(block_keys([1, 2, 3, 4], 2)) == 2
    index.apply(Event("removed", (101,)))
    assert index.leading(block_keys([1, 2, 3, 4], 2)) == 0
    index.apply(Event("cleared"))
    assert len(index) == 0


def test_a_block_whose_parent_is_unknown_is_held_by_its_hash_alone_and_the_index_is_bounded():
    index = BlockIndex(capacity=3)
    index.apply(stored([5], [7, 7], parent=999))
    assert (len(index), index.orphans, index.partial) == (2, 1, True)  # with its parent
    assert index.holds_hash(5) and index.holds_hash(999) and not index.holds(block_keys([7, 7], 2)[0])
    index.apply(stored([1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]))
    assert len(index) == 3 and not index.holds(block_keys([1, 2], 2)[0])  # the oldest went
    assert ROOT_KEY == 0


def index_of(*events: Any) -> BlockIndex:
    """The index one batch of the simulator's (vLLM's) event structs gives."""
    index = BlockIndex(100)
    payload = msgspec.msgpack.encode(sim_events.KVEventBatch(ts=1.0, events=list(events)))
    for event in decode_batch(payload).events:
        index.apply(event)
    return index


def vllm_stored(hashes: list[int], tokens_: list[int], **fields: Any) -> Any:
    return sim_events.BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens_, block_size=2,
        lora_id=None, medium=fields.pop("medium", "GPU"), lora_name=fields.pop("lora", None),
        **fields,
    )


@pytest.mark.parametrize("encode", ["maps", "arrays"])
def test_blocks_vllm_hashes_with_more_than_their_tokens_never_match_a_plain_prompt(encode):
    """An adapter's blocks, a salted prompt's (`cache_salt`, multimodal inputs: extra keys)
    hold the same tokens as a base-model prompt's but not the same KV: they never match a
    prompt's plain keys, and their children chain under them; plain blocks still match."""
    tokens_ = [1, 2, 3, 4]
    plain = block_keys(tokens_, 2)
    cases = {
        "base": vllm_stored([1, 2], tokens_),
        "adapter": vllm_stored([1, 2], tokens_, lora="sql-lora"),
        "salt": vllm_stored([1, 2], tokens_, extra_keys=[("salt-a",), ("salt-a",)]),
    }
    held = {}
    for name, event in cases.items():
        if encode == "arrays":  # the earlier producers' encoding: arrays led by the tag
            fields = [getattr(event, f, None) for f in ("block_hashes", "parent_block_hash",
                      "token_ids", "block_size", "lora_id", "medium", "lora_name",
                      "extra_keys", "group_idx")]  # fmt: skip
            payload = msgspec.msgpack.encode([1.0, [["BlockStored", *fields]]])
            index = BlockIndex(100)
            for e in decode_batch(payload).events:
                index.apply(e)
        else:
            index = index_of(event)
        held[name] = (len(index), index.leading(plain))
    assert held == {"base": (2, 2), "adapter": (2, 0), "salt": (2, 0)}


def test_another_tier_or_kv_cache_group_is_not_the_gpus_prefix_cache():
    """A block offloaded to CPU, or a hybrid model's other KV cache group, is not what a
    prompt hits on the GPU: not indexed, and its removal leaves the GPU's copy held."""
    tokens_ = [1, 2, 3, 4]
    plain = block_keys(tokens_, 2)
    assert index_of(vllm_stored([1, 2], tokens_, medium="CPU")).leading(plain) == 0
    assert index_of(vllm_stored([1, 2], tokens_, group_idx=1)).leading(plain) == 0
    index = index_of(
        vllm_stored([1, 2], tokens_),
        sim_events.BlockRemoved(block_hashes=[1, 2], medium="CPU"),  # the offloaded copy
        sim_events.BlockRemoved(block_hashes=[1, 2], medium="GPU", group_idx=1),
    )
    assert index.leading(plain) == 2
    assert index_of(vllm_stored([1, 2], tokens_),
                    sim_events.BlockRemoved(block_hashes=[2], medium="GPU")).leading(plain) == 1


def test_sequence_numbers_say_apply_gap_duplicate_or_restarted():
    seq = Sequencer()
    assert seq.verdict(5, 0) == "first"
    seq.last = 5
    assert [seq.verdict(n, 0) for n in (6, 9, 5, 0)] == ["apply", "gap", "regressed", "regressed"]
    seq.last, seq.replayed = 12, {10: 111, 11: 222, 12: 333}  # a replay brought 10..12
    assert [seq.verdict(n, d) for n, d in ((11, 222), (12, 333), (13, 0))] == [
        "duplicate", "duplicate", "apply"]
    # a restarted engine's batch 11 is not the one the replay brought: the engine restarted
    assert seq.verdict(11, 999) == "regressed"


# --------------------------------------------------------------------------- against the sim


async def started(replica: SimReplica, state: ReplicaEvents | None = None) -> tuple[
    Subscriber, ReplicaEvents, asyncio.Task[None]
]:
    endpoints = replica.kv_events_endpoints
    assert endpoints is not None
    state = state or ReplicaEvents(BlockIndex(replica.config.num_gpu_blocks))
    subscriber = Subscriber("a", endpoints["endpoint"], endpoints["replay_endpoint"],
                            SETTINGS, state, Metrics())
    return subscriber, state, asyncio.create_task(subscriber.run())


async def stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def rebuilt(batches: list[tuple[int, Any]], capacity: int) -> BlockIndex:
    """The index that every batch the replica buffers gives, applied in order."""
    index = BlockIndex(capacity)
    for _, payload in batches:
        for event in decode_batch(payload).events:
            index.apply(event)
    return index


async def test_the_index_follows_what_the_replica_stores_and_evicts(sim_factory):
    replica = await sim_factory(**SIM)
    async with aiohttp.ClientSession() as http:
        _, state, task = await started(replica)
        try:
            await joined(http, replica, state)
            await complete(http, replica, PROMPT)
            await caught_up(replica, state)
            ids = await tokens(http, replica, PROMPT)
            assert state.index.leading(block_keys(ids, 16)) == len(ids) // 16
            for i in range(12):  # others push the prompt's blocks out of a 63-block pool
                await complete(http, replica, f"topic {i} " + PROMPT)
            await caught_up(replica, state)
            assert state.index.leading(block_keys(ids, 16)) == 0
            expected = rebuilt(await replay(replica, raw=True), replica.config.num_gpu_blocks)
            assert state.index.keys() == expected.keys() and len(expected) > 0
            assert (state.gaps, state.resets) == (0, 0)
        finally:
            await stopped(task)


async def test_an_eviction_under_pressure_undoes_a_recent_prompts_expectation(sim_factory):
    """A prompt sent to a replica counts as cached there for EXPECTED_S; when the replica
    evicts its blocks under pressure within that time, the batch that says so ends the
    expectation, and the prompt no longer draws traffic there (the clock never moves here:
    only the events can undo it)."""
    from kvgate.fleet.block_index import LazyKeys

    replica = await sim_factory(**SIM)
    events = KvEvents(Metrics(), clock=lambda: 0.0)
    async with aiohttp.ClientSession() as http:
        _, state, task = await started(replica)
        events.states["a"] = state
        try:
            await joined(http, replica, state)
            ids = tuple(await tokens(http, replica, PROMPT))
            blocks = len(ids) // 16
            events.expect("a", LazyKeys(ids, 16))  # routed there: cached as far as routing knows
            await complete(http, replica, PROMPT)
            await caught_up(replica, state)
            assert events.cached_blocks("a", LazyKeys(ids, 16)) == blocks
            for i in range(12):  # others push the prompt's blocks out of a 63-block pool
                await complete(http, replica, f"topic {i} " + PROMPT)
            await caught_up(replica, state)
            assert state.index.leading(block_keys(ids, 16)) == 0
            assert events.cached_blocks("a", LazyKeys(ids, 16)) == 0
        finally:
            await stopped(task)


async def test_a_subscriber_that_starts_late_replays_from_zero(sim_factory):
    """A kvgate restart: the replica has been publishing; a new subscriber's first batch
    sets off a replay of everything still buffered, parents included."""
    replica = await sim_factory(**{**SIM, "num_gpu_blocks": 512})  # nothing evicted here
    async with aiohttp.ClientSession() as http:
        for i in range(3):
            await complete(http, replica, f"before {i} " + PROMPT)
        _, state, task = await started(replica)
        try:
            after = iter(range(1 << 20))  # a new prompt at each try: new blocks, a batch
            await joined(http, replica, state,
                         lambda: complete(http, replica, f"after {next(after)} " + PROMPT))
            await caught_up(replica, state)
            ids = await tokens(http, replica, "before 0 " + PROMPT)
            assert state.index.leading(block_keys(ids, 16)) == len(ids) // 16
            expected = rebuilt(await replay(replica, raw=True), replica.config.num_gpu_blocks)
            assert state.index.keys() == expected.keys()
        finally:
            await stopped(task)


async def test_an_engine_restart_resets_the_index_and_replays_from_zero(sim_factory):
    replica = await sim_factory(**SIM)
    async with aiohttp.ClientSession() as http:
        _, state, task = await started(replica)
        try:
            await joined(http, replica, state)
            for i in range(10):
                await complete(http, replica, f"{i} " + PROMPT)
            await caught_up(replica, state)
            old = await tokens(http, replica, "9 " + PROMPT)  # the latest: still cached
            assert state.index.leading(block_keys(old, 16)) > 0
            await replica.restart()  # a new engine: an empty cache, sequence numbers from 0
            for i in range(100):  # the SUB socket reconnects by itself (in a few hundred ms)
                await complete(http, replica, f"fresh {i} " + PROMPT)
                if state.resets:
                    break
                await asyncio.sleep(0.05)
            await caught_up(replica, state)
            assert state.resets == 1
            assert state.index.leading(block_keys(old, 16)) == 0  # nothing stale is left
            expected = rebuilt(await replay(replica, raw=True), replica.config.num_gpu_blocks)
            assert state.index.keys() == expected.keys()
        finally:
            await stopped(task)


async def test_a_gap_is_filled_from_the_replay_socket(sim_factory):
    replica = await sim_factory(**SIM)
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            await complete(http, replica, f"{i} " + PROMPT)
    batches = await replay(replica, raw=True)
    assert len(batches) >= 3
    subscriber, state, task = await started(replica)
    await stopped(task)  # fed by hand below: batch 1 never arrives live
    await subscriber.receive(*batches[0])  # first: replays everything from 0
    assert state.sequencer.last == batches[-1][0]
    state.index.clear()
    state.sequencer = Sequencer()
    state.sequencer.last = 0
    for event in decode_batch(batches[0][1]).events:
        state.index.apply(event)
    await subscriber.receive(*batches[2])  # 1 is missing: replayed from 1
    assert state.gaps == 1 and state.sequencer.last == batches[-1][0]
    assert state.index.keys() == rebuilt(batches, replica.config.num_gpu_blocks).keys()
    await subscriber.receive(*batches[-1])  # live again, already applied: a duplicate
    assert state.gaps == 1 and state.resets == 0


async def test_without_a_replay_socket_a_gap_is_counted_and_the_batch_still_applied(
    sim_factory
):
    replica = await sim_factory(**SIM)
    async with aiohttp.ClientSession() as http:
        for i in range(3):
            await complete(http, replica, f"{i} " + PROMPT)
    batches = await replay(replica, raw=True)
    state = ReplicaEvents(BlockIndex(64))
    subscriber = Subscriber("a", "tcp://127.0.0.1:1", None, SETTINGS, state, Metrics())
    await subscriber.receive(*batches[0])
    await subscriber.receive(*batches[2])
    assert state.gaps == 1 and state.sequencer.last == batches[2][0]


# --------------------------------------------------------------------------- the fleet


def test_a_replicas_endpoints_are_its_own_or_its_hosts_at_the_pools_ports():
    def of(url: str, **kw: Any) -> Replica:
        return Replica(config=ReplicaConfig(url=url, **kw), pool="p", healthy=True)

    assert endpoints_of(of("http://gpu-a:8000"), SETTINGS) == (
        "tcp://gpu-a:5557", "tcp://gpu-a:5558")
    assert endpoints_of(of("http://[fd00::1]:8000"), KvEventsConfig(replay_port=None)) == (
        "tcp://[fd00::1]:5557", None)
    own = KvEventsEndpoints(endpoint="tcp://10.0.0.5:6000")
    assert endpoints_of(of("http://gpu-a:8000", kv_events=own), SETTINGS) == (
        "tcp://10.0.0.5:6000", None)
    # a data-parallel rank publishes at the ports + its rank, its own endpoints' included
    assert endpoints_of(of("http://[fd00::1]:8000"), SETTINGS, rank=2) == (
        "tcp://[fd00::1]:5559", "tcp://[fd00::1]:5560")
    assert endpoints_of(of("http://gpu-a:8000", kv_events=own), SETTINGS, rank=1) == (
        "tcp://10.0.0.5:6001", None)


async def test_the_fleet_drops_the_index_of_a_replica_that_fails_or_goes_silent(sim_factory):
    replica = await sim_factory(**SIM)
    endpoints = replica.kv_events_endpoints
    assert endpoints is not None
    r = Replica(config=ReplicaConfig(url=replica.url, name="a", num_gpu_blocks=64,
                                     kv_events=KvEventsEndpoints(**endpoints)),
                pool="default", healthy=True)  # fmt: skip
    config = parse_config({"pools": {"default": {
        "replicas": [{"url": replica.url, "name": "a"}], "kv_events": {"silent_after_s": 5}}}})
    now = [0.0]
    events = KvEvents(Metrics(), clock=lambda: now[0])
    try:
        events.sync([r], config)
        async with aiohttp.ClientSession() as http:
            await joined(http, replica, events.states["a"])
            for i in range(3):
                await complete(http, replica, f"{i} " + PROMPT)
        assert events.index("a") is not None and events.describe("a")["subscribed"]
        r.healthy = False
        events.sync([r], config)
        assert events.index("a") is None and not events.describe("a")["subscribed"]
        r.healthy = True
        events.sync([r], config)
        assert events.describe("a")["subscribed"]
        state = events.states["a"]
        state.last_event_at, state.sequencer.last = 0.0, 3
        r.scrape = Scrape(at=0.0, prefix_queries=5000.0, prefix_hits=4000.0)
        events.sync([r], config)  # the counters as the last batch left them
        now[0] = 6.0  # nothing published for 6 s, but every prompt was a hit: not silent
        r.scrape = Scrape(at=6.0, prefix_queries=9000.0, prefix_hits=8000.0)
        events.sync([r], config)
        assert events.index("a") is not None
        # 1,024 more prompt tokens computed, stored, and nothing published: silent
        r.scrape = Scrape(at=6.1, prefix_queries=10_100.0, prefix_hits=8000.0)
        events.sync([r], config)
        assert events.index("a") is None
        events.sync([], config)  # it left the fleet
        assert events.describe("a") is None
    finally:
        await events.close()


async def test_the_index_is_bounded_by_the_replicas_capacity_once_discovery_knows_it():
    """The first sync usually runs before discovery's first scrape: the bound is the
    replica's own blocks from the scrape that tells them, not 2^20 for ever."""
    r = Replica(config=ReplicaConfig(url="http://gpu-a:8000", name="a"), pool="default",
                healthy=False)  # not subscribed: only the bound is at stake  # fmt: skip
    config = parse_config({"pools": {"default": {
        "replicas": [{"url": "http://gpu-a:8000", "name": "a"}], "kv_events": {}}}})
    events = KvEvents(Metrics())
    try:
        events.sync([r], config)
        index = events.states["a"].index
        for i in range(100):
            index.apply(stored([i], [i, i], parent=None if i == 0 else i - 1))
        assert index.capacity == 1 << 20 and len(index) == 100
        r.scrape = Scrape(at=0.0, num_gpu_blocks=64)
        events.sync([r], config)
        assert events.states["a"].index is index and index.capacity == 64
        assert len(index) == 64  # the oldest went
    finally:
        await events.close()


async def test_each_engine_a_replica_names_is_a_stream_and_a_pin_names_its_place():
    """A server running data-parallel ranks 2 and 3 (vLLM's hybrid balancing: another server
    runs 0 and 1): each rank is followed at the ports + its rank, bounded by its share of
    the replica's blocks; the replica holds what its deepest rank holds; and a pin names the
    engine's place among the server's (vLLM indexes its engines so), not its rank."""
    r = Replica(config=ReplicaConfig(url="http://gpu-a:8000", name="h"), pool="default",
                healthy=True, scrape=Scrape(at=0.0, num_gpu_blocks=200, engines=(2, 3)))
    config = parse_config({"pools": {"default": {
        "replicas": [{"url": "http://gpu-a:8000", "name": "h"}], "kv_events": {}}}})
    events = KvEvents(Metrics())
    try:
        events.sync([r], config)
        assert set(events.states) == {"h/dp2", "h/dp3"}
        ranks = (events.describe("h") or {})["ranks"]
        assert {rank: r["endpoint"] for rank, r in ranks.items()} == {
            "2": "tcp://gpu-a:5559", "3": "tcp://gpu-a:5560"}  # replays at 5560 and 5561
        assert all(state.index.capacity == 100 for state in events.states.values())
        prompt = tuple(range(64))  # four blocks of 16
        assert events.cached_blocks("h", LazyKeys(prompt, 16)) is None  # nothing heard yet
        for state in events.states.values():
            state.sequencer.last = 0
        events.states["h/dp3"].index.apply(
            Event("stored", (1, 2, 3), None, prompt[:48], 16))
        events.states["h/dp2"].index.apply(Event("stored", (9,), None, prompt[:16], 16))
        assert events.cached_blocks("h", LazyKeys(prompt, 16)) == 3
        assert events.rank_for("h", LazyKeys(prompt, 16)) == 1  # rank 3: the server's second engine
        events.expect("h", LazyKeys(prompt, 16), 1)
        assert set(events.states["h/dp3"].expected) and not events.states["h/dp2"].expected
        other = tuple(range(100, 132))
        assert events.rank_for("h", LazyKeys(other, 16)) is None  # no engine holds it: vLLM picks
        events.expect("h", LazyKeys(other, 16))  # then each expects it
        assert all(len(s.expiries) >= 1 for s in events.states.values())
        described = events.describe("h")
        assert described is not None and set(described["ranks"]) == {"2", "3"}
        assert described["blocks"] == 4
    finally:
        await events.close()


async def test_a_subscription_made_again_starts_from_an_empty_index_and_a_replay(
    sim_factory, monkeypatch
):
    """Whatever the subscriber missed while its socket was gone (an engine's restart among
    it) is read afresh from a replay from 0, not applied over the old index."""
    import kvgate.fleet.kv_subscriber as kv_subscriber

    monkeypatch.setattr(kv_subscriber, "RETRY_S", 0.05)
    replica = await sim_factory(**SIM)
    async with aiohttp.ClientSession() as http:
        subscriber, state, task = await started(replica)
        try:
            await joined(http, replica, state)
            await complete(http, replica, PROMPT)
            await caught_up(replica, state)
            stale = 10**9  # a block the replica does not hold, left from before
            state.index.apply(stored([stale], [7, 7]))
            assert state.index.holds(chain_key(ROOT_KEY, (7, 7)))
            failing = subscriber.receive

            async def fail_once(seq: int, payload: bytes) -> None:
                subscriber.receive = failing  # type: ignore[method-assign]
                raise ConnectionError("the socket went away")

            subscriber.receive = fail_once  # type: ignore[method-assign]
            await complete(http, replica, "another " + PROMPT)  # its batch meets the error
            await eventually(lambda: state.resets == 1, what="the reset")
            await joined(http, replica, state)
            await caught_up(replica, state)
            assert not state.index.holds(chain_key(ROOT_KEY, (7, 7)))  # gone with the old
            expected = rebuilt(await replay(replica, raw=True), replica.config.num_gpu_blocks)
            assert state.index.keys() == expected.keys()
        finally:
            await stopped(task)


def test_blocks_under_a_parent_the_index_never_saw_are_counted_and_reported():
    events = KvEvents(Metrics())
    state = events.states["a"] = ReplicaEvents(BlockIndex(100))
    subscriber = Subscriber("a", "tcp://x:1", None, SETTINGS, state, events.metrics)
    payload = msgspec.msgpack.encode(sim_events.KVEventBatch(ts=1.0, events=[
        sim_events.BlockStored(block_hashes=[5, 6], parent_block_hash=99, token_ids=[1, 2, 3, 4],
                               block_size=2, lora_id=None, medium="GPU", lora_name=None),
    ]))  # fmt: skip
    subscriber._apply(0, payload)
    # held by their hashes alone, with the parent they were stored under: the index is partial
    described = events.describe("a")
    assert len(state.index) == 3 and not state.index.holds(block_keys([1, 2], 2)[0])
    assert (described["orphan_blocks"], described["partial"]) == (2, True)
    counted = events.metrics.registry.get_sample_value(
        "kvgate_kv_index_orphan_blocks_total", {"replica": "a"})
    assert counted == 2


async def test_an_engine_that_started_again_is_read_afresh_whatever_its_numbers_say(sim_factory):
    """A replica whose engine restarted while its subscriber heard nothing (its sequence
    numbers may have passed the old ones: no regression to see) is known by its counters'
    start, and its index is emptied and read again from a replay."""
    replica = await sim_factory(**SIM)
    r = Replica(config=ReplicaConfig(url=replica.url, name="a", num_gpu_blocks=64,
                                     kv_events=KvEventsEndpoints(**replica.kv_events_endpoints)),
                pool="default", healthy=True)  # fmt: skip
    config = parse_config({"pools": {"default": {
        "replicas": [{"url": replica.url, "name": "a"}], "kv_events": {}}}})
    events = KvEvents(Metrics())

    async def scraped(http: aiohttp.ClientSession) -> Scrape:
        from kvgate.fleet.scrape import parse_vllm_metrics

        async with http.get(f"{replica.url}/metrics") as response:
            return parse_vllm_metrics(await response.text(), 0.0)

    try:
        async with aiohttp.ClientSession() as http:
            r.scrape = await scraped(http)
            assert r.scrape.started_at is not None
            events.sync([r], config)
            await joined(http, replica, events.states["a"])
            await complete(http, replica, PROMPT)
            await caught_up(replica, events.states["a"])
            before = events.states["a"]
            events.sync([r], config)  # the same engine: nothing changes
            assert events.states["a"] is before and events.index("a") is not None
            await asyncio.sleep(0.01)
            await replica.restart()
            r.scrape = await scraped(http)
            events.sync([r], config)
            assert events.states["a"] is not before and events.index("a") is None
            reset = events.metrics.registry.get_sample_value(
                "kvgate_kv_events_resets_total", {"replica": "a", "reason": "restarted"})
            assert reset == 1
    finally:
        await events.close()


def test_the_endpoints_config_is_checked():
    with pytest.raises(ValueError, match="endpoint"):
        KvEventsEndpoints(endpoint="gpu-a:5557")
    assert json.loads(KvEventsConfig().model_dump_json())["port"] == 5557


def test_a_prompt_just_sent_counts_as_cached_until_its_events_come_or_it_expires():
    """A burst for one new document: the first request's blocks are not published before the
    next is placed, so a prompt sent to a replica counts as cached there for EXPECTED_S."""
    from kvgate.fleet.block_index import LazyKeys
    from kvgate.fleet.kv_events import EXPECTED_S

    now = [0.0]
    events = KvEvents(Metrics(), clock=lambda: now[0])
    state = events.states["a"] = ReplicaEvents(BlockIndex(100))
    prompt = tuple(range(64))  # four blocks of 16
    assert events.cached_blocks("a", LazyKeys(prompt, 16)) is None  # not heard from yet
    state.sequencer.last = 0
    events.expect("a", LazyKeys(prompt[:48], 16))
    assert events.cached_blocks("a", LazyKeys(prompt, 16)) == 3
    now[0] = EXPECTED_S + 1  # its events never came: an expectation, not a fact
    assert events.cached_blocks("a", LazyKeys(prompt, 16)) == 0
    events.expect("a", LazyKeys(prompt, 16))
    state.index.apply(Event("cleared"))  # as a batch with AllBlocksCleared would
    state.forget_expected()
    assert events.cached_blocks("a", LazyKeys(prompt, 16)) == 0 and not state.expected


async def test_a_replay_answered_without_the_topic_frame_as_earlier_vllm_did_is_read():
    """vLLM 0.33 answers a replay (identity, "", topic, seq, payload); earlier versions left
    the topic out. Both are read, end marker included."""
    import zmq
    import zmq.asyncio

    from kvgate.fleet.kv_subscriber import END_SEQ

    batch = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [5],
                                           "parent_block_hash": None, "token_ids": list(range(16)),
                                           "block_size": 16, "lora_id": None, "medium": "GPU"}]])
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        identity, _, start = await router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        await router.send_multipart((identity, b"", (0).to_bytes(8, "big"), batch))
        await router.send_multipart((identity, b"", END_SEQ.to_bytes(8, "big", signed=True), b""))

    server = asyncio.create_task(serve())
    state = ReplicaEvents(BlockIndex(64))
    subscriber = Subscriber("a", "tcp://127.0.0.1:1", f"tcp://127.0.0.1:{port}",
                            SETTINGS, state, Metrics())
    try:
        await subscriber.receive(0, batch)  # first: replays from 0, three-frame answers
        await server
        assert state.sequencer.last == 0 and len(state.index) == 1 and state.gaps == 0
    finally:
        router.close()


async def test_whatever_a_producer_sends_the_subscriber_reads_on():
    state = ReplicaEvents(BlockIndex(64))
    subscriber = Subscriber("a", "tcp://127.0.0.1:1", None, SETTINGS, state, Metrics())
    unhashable = msgspec.msgpack.encode(
        {"ts": 1.0, "events": [["BlockRemoved", [[1, 2]]]]})  # a hash that is a list
    for seq, payload in enumerate((b"\xc1", unhashable, msgspec.msgpack.encode([1.0, []]))):
        await subscriber.receive(seq, payload)
    assert state.sequencer.last == 2 and state.batches == 3
