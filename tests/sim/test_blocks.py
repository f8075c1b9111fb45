"""The KV block pool and its prefix cache, without an engine."""

from __future__ import annotations

import pytest

from kvgate.sim.blocks import ROOT_HASH, BlockPool, block_hashes, chain_hash


def test_block_zero_is_never_handed_out_and_usage_excludes_it() -> None:
    pool = BlockPool(11)
    taken = pool.allocate(10)
    assert 0 not in [b.block_id for b in taken]
    assert pool.num_free_blocks == 0
    assert pool.usage() == 1.0
    pool.free(taken[:5])
    assert pool.usage() == pytest.approx(1 - 5 / 10)


def test_cached_blocks_no_request_holds_count_as_free() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], 111)
    pool.cache(blocks[1], 222)
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 4
    assert pool.usage() == 0.0
    assert pool.num_cached_blocks == 2
    assert pool.get_cached(111) is blocks[0]


def test_a_cache_hit_leaves_the_free_queue_and_takes_a_reference() -> None:
    pool = BlockPool(5)
    (block,) = pool.allocate(1)
    pool.cache(block, 7)
    pool.free([block])
    pool.touch([block])
    assert block.ref_cnt == 1
    assert block.block_id not in pool.free_block_ids()
    pool.touch([block])
    pool.free([block])
    assert block.ref_cnt == 1  # still held by the other request


def test_allocation_takes_least_recently_freed_blocks_and_evicts_their_hashes() -> None:
    pool = BlockPool(5)  # usable: 1, 2, 3, 4
    chain = pool.allocate(2)  # blocks 1 and 2
    pool.cache(chain[0], 10)
    pool.cache(chain[1], 20)
    pool.free(reversed(chain))  # tail first: queue is 3, 4, 2, 1
    assert pool.free_block_ids() == [3, 4, 2, 1]
    assert [b.block_id for b in pool.allocate(3)] == [3, 4, 2]
    assert pool.get_cached(20) is None  # the chain's tail went first
    assert pool.get_cached(10) is chain[0]  # its start survives
    assert pool.evictions == 1


def test_one_differing_token_changes_that_block_and_every_block_after_it() -> None:
    a = list(range(12))
    b = [*a[:5], 99, *a[6:]]
    ha, hb = block_hashes(a, 4), block_hashes(b, 4)
    assert len(ha) == 3
    assert ha[0] == hb[0]
    assert ha[1] != hb[1] and ha[2] != hb[2]
    assert ha[0] == chain_hash(ROOT_HASH, a[:4])


def test_only_full_blocks_are_hashed_and_hashes_extend_incrementally() -> None:
    tokens = list(range(10))
    first = block_hashes(tokens, 4)
    assert len(first) == 2
    tokens += [10, 11]
    assert block_hashes(tokens, 4, first) == block_hashes(tokens, 4)
