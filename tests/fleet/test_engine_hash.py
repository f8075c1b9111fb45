"""vLLM's own block hashes in kvgate: blocks stored under a prefix the index never saw (kvgate
started after it was cached, past the engine's replay buffer) match a request's prompt by the
engine's hash, and heal the index; a replica that hashes otherwise is matched by content
alone; and, against the simulator (which hashes as vLLM does by default), a kvgate restart
leaves the hot prefix found by the first request stored under it. That kvgate's hashes are
vLLM's own is proven in tests/conformance (vLLM's functions) and tests/real (its engine)."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import aiohttp
import pytest

from kvgate.config import KvEventsEndpoints, ReplicaConfig, parse_config
from kvgate.fleet.block_index import BlockIndex, LazyKeys, block_keys
from kvgate.fleet.engine_hash import (
    DEFAULT_SEED,
    SCAN_BLOCKS,
    EngineHashes,
    EngineMatch,
    published,
)
from kvgate.fleet.kv_events import KvEvents
from kvgate.fleet.kv_wire import Event
from kvgate.fleet.replicas import Replica
from kvgate.metrics import Metrics
from tests.plugins.kv_events import SIM, caught_up, complete, joined, tokens

SIZE = 4


def stored(hashes: list[Any], tokens_: list[int], parent: Any = None) -> Event:
    return Event("stored", tuple(hashes), parent, tuple(tokens_), SIZE)


def test_the_hash_is_sha256_of_the_pickled_block_chained_from_vllms_seed() -> None:
    engine = EngineHashes()
    none = hashlib.sha256(pickle.dumps(DEFAULT_SEED, protocol=5)).digest()
    first = hashlib.sha256(pickle.dumps((none, (1, 2, 3, 4), None), protocol=5)).digest()
    assert engine.none_hash == none and engine.chain(None, [1, 2, 3, 4]) == first
    assert engine.block_hashes([1, 2, 3, 4, 5], SIZE) == [int.from_bytes(first[-8:], "big")]
    assert published(first, ints=False) == first
    # another seed (PYTHONHASHSEED on the engine), another algorithm: other hashes
    assert EngineHashes(seed="42").chain(None, [1, 2, 3, 4]) != first
    assert EngineHashes("sha256_cbor").chain(None, [1, 2, 3, 4]) != first


def system_and(question: list[int]) -> list[int]:
    return [*range(100, 100 + 6 * SIZE), *question]  # a system prompt of six blocks


def test_blocks_under_a_prefix_the_index_never_saw_match_by_the_engines_hash_and_heal() -> None:
    engine, index = EngineHashes(), BlockIndex(1000)
    match = EngineMatch(engine, "a")
    second = system_and([7] * 8)
    hashes = engine.block_hashes(second, SIZE)
    # the system prompt was cached before kvgate subscribed: only the question's blocks come
    index.apply(stored(hashes[6:], second[6 * SIZE :], parent=hashes[5]))
    assert index.orphans == 2 and index.partial and len(index) == 3  # the parent, inferred
    third = system_and([9] * 8)
    assert index.leading(block_keys(third, SIZE)) == 0  # by content: nothing is known
    assert match.leading(LazyKeys(third, SIZE), index, index.holds) == 6
    # what the match found is now keyed by content: the next prompt finds it cheaply
    assert index.leading(block_keys(third, SIZE)) == 6
    assert match.leading(LazyKeys(second, SIZE), index, index.holds) == 8
    assert not index.partial and index.orphans == 2  # every block known by its content now
    # an eviction undoes the inferred parent as any block
    assert index.apply(Event("removed", (hashes[5],), None, (), 0))
    assert index.leading(block_keys(third, SIZE)) == 5


def test_a_replica_that_hashes_otherwise_is_matched_by_content_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, index = EngineHashes(), BlockIndex(1000)
    match = EngineMatch(engine, "a")
    prompt = system_and([7] * 8)
    theirs = EngineHashes(seed="a PYTHONHASHSEED kvgate was not told").block_hashes(prompt, SIZE)
    match.check(theirs[0], prompt[:SIZE])  # its first root block
    assert match.agrees is False and "hashes blocks otherwise" in caplog.text
    index.apply(stored(theirs[6:], prompt[6 * SIZE :], parent=theirs[5]))
    assert match.leading(LazyKeys(prompt, SIZE), index, index.holds) == 0
    agreeing = EngineMatch(engine, "b")
    agreeing.check(engine.block_hashes(prompt, SIZE)[0], prompt[:SIZE])
    assert agreeing.agrees is True and agreeing.ints


def test_the_search_past_the_known_blocks_is_bounded() -> None:
    engine, index = EngineHashes(), BlockIndex(100_000)
    match = EngineMatch(engine, "a")
    long = list(range(SIZE * (SCAN_BLOCKS + 10)))
    hashes = engine.block_hashes(long, SIZE)
    deep = SCAN_BLOCKS + 5  # held by hash alone, past the bound
    index.apply(stored(hashes[deep : deep + 1], long[deep * SIZE : (deep + 1) * SIZE],
                       parent=hashes[deep - 1]))  # fmt: skip
    prompt = LazyKeys(long, SIZE)
    assert match.leading(prompt, index, index.holds) == 0
    assert prompt.hashed == SCAN_BLOCKS  # hashed no further


async def test_a_hot_prefix_cached_before_kvgate_subscribed_is_found_by_the_next_prompt(
    sim_factory: Any,
) -> None:
    """kvgate restarts: the system prompt was cached an hour ago and is not in any replay.
    Another client's question under it stores its own blocks under the cached prefix; from
    that batch on, a third question is routed by the whole system prompt."""
    replica = await sim_factory(**SIM)
    system = " ".join(f"rule{i} applies" for i in range(60))
    endpoints = replica.kv_events_endpoints
    r = Replica(config=ReplicaConfig(url=replica.url, name="a", num_gpu_blocks=64,
                                     kv_events=KvEventsEndpoints(endpoint=endpoints["endpoint"])),
                pool="default", healthy=True)  # fmt: skip
    config = parse_config({"pools": {"default": {
        "replicas": [{"url": replica.url, "name": "a"}], "kv_events": {"replay_port": None}}}})
    events = KvEvents(Metrics())
    try:
        async with aiohttp.ClientSession() as http:
            ask = "? Explain it with three examples from practice, in plain words, briefly."
            await complete(http, replica, f"{system}. What is rule 1{ask}")  # long before
            events.sync([r], config)  # no replay: what came before is never heard
            state = events.states["a"]
            warm = iter(range(1000))
            await joined(http, replica, state, lambda: complete(
                http, replica, f"unrelated {next(warm)} " + "filler " * 20))  # fmt: skip
            await complete(http, replica, f"{system}. What is rule 2{ask}")
            await caught_up(replica, state)
            second = await tokens(http, replica, f"{system}. What is rule 2{ask}")
            third = await tokens(http, replica, f"{system}. What is rule 3{ask}")
            differ = next(i for i, (a, b) in enumerate(zip(second, third, strict=False)) if a != b)
            shared = differ // 16
            assert shared >= 8 and state.index.orphans > 0
            assert state.index.leading(block_keys(third, 16)) == 0  # by content: unknown
            assert events.cached_blocks("a", LazyKeys(third, 16)) == shared
            # healed by that match: the next prompt finds the system prompt by content
            assert state.index.leading(block_keys(third, 16)) == shared
    finally:
        await events.close()
