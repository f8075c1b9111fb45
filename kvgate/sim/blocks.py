"""The paged KV pool and its prefix cache, as vLLM V1's `BlockPool` keeps them.

- Block 0 is the null block: never handed out, so `num_gpu_blocks - 1` blocks are usable and
  the usage gauge is `1 - free / (num_gpu_blocks - 1)`.
- Free blocks sit in one queue. A freed block keeps its hash (it is still a prefix-cache
  entry) until it is popped from the head of the queue for new tokens; only then is its hash
  evicted. Cached blocks that no request holds therefore count as free. Freed blocks with a
  hash join the tail (LRU); freed blocks without one join the head, reused first.
- A block is identified in the cache by a hash chained over its parent's hash and its own
  token ids, so one differing token changes that block and every block after it.
- With KV events on (`events` a list), the pool records what vLLM's publishes: a
  `BlockStored` for each run of blocks that filled, a `BlockRemoved` for each evicted hash,
  `AllBlocksCleared` on a reset; the engine takes them after each step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvgate.fleet.engine_hash import EngineHashes
from kvgate.sim.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

# Blocks are hashed as vLLM hashes them by default (sha256 of the pickled block, its chain
# from NONE_HASH of vLLM's own seed), so that a gateway computes the simulator's hashes as it
# computes a real engine's (`kvgate.fleet.engine_hash`). A hash is the digest as an int.
_ENGINE = EngineHashes()
ROOT_HASH = int.from_bytes(_ENGINE.none_hash, "big")
# Hashes leave the simulator as unsigned 64-bit ids (vLLM's ExternalBlockHash of an int).
_ID_MASK = (1 << 64) - 1


def external(block_hash: int) -> int:
    return block_hash & _ID_MASK


def chain_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The hash of one full block: parent hash and the block's token ids."""
    return int.from_bytes(_ENGINE.chain(parent.to_bytes(32, "big"), token_ids), "big")


def block_hashes(token_ids: Sequence[int], block_size: int, start: Sequence[int] = ()) -> list[int]:
    """Hashes of every full block of `token_ids`, extending the already known chain `start`."""
    hashes = list(start)
    parent = hashes[-1] if hashes else ROOT_HASH
    for first in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[first : first + block_size])
        hashes.append(parent)
    return hashes


class Block:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Blocks, their reference counts, the LRU free queue and the hash → block map."""

    def __init__(
        self, num_gpu_blocks: int, enable_caching: bool = True, events: bool = False
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        # Head = next to reuse (least recently freed). Block 0 (null) is never free.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        # A hash may map to several blocks when two requests computed the same prefix at once.
        self._cached: dict[int, dict[int, Block]] = {}
        self.evictions = 0
        self.events: list[KVCacheEvent] | None = [] if events else None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a hash, held or not."""
        return sum(len(blocks) for blocks in self._cached.values())

    def usage(self) -> float:
        """`vllm:kv_cache_usage_perc`: the fraction of usable blocks some request holds."""
        return 1.0 - self.num_free_blocks / (self.num_gpu_blocks - 1)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next evicted) first."""
        return list(self._free)

    def get_cached(self, block_hash: int) -> Block | None:
        blocks = self._cached.get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def allocate(self, n: int) -> list[Block]:
        """Take `n` blocks from the head of the free queue, evicting their cache entries."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: {len(self._free)} free")
        taken: list[Block] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-cache hits; unheld ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a reference on each block, in the order given (first = evicted first).

        As vLLM's `BlockPool.free_blocks`: unheld blocks that carry a hash join the tail of the
        queue (LRU: a cached prefix stays as long as it can), unheld blocks without one go to
        its head, to be reused first. Callers pass a request's blocks tail first, so the end of
        a chain is evicted before its start.
        """
        first: list[Block] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    first.append(block)
                else:
                    self._free[block.block_id] = block
        for block in reversed(first):
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: Block, block_hash: int) -> bool:
        """Give a full block its hash; False if it had one (a prefix-cache hit) or caching
        is off."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, {})[block.block_id] = block
        return True

    def cache_full(
        self, blocks: Sequence[Block], hashes: Sequence[int], token_ids: Sequence[int],
        start: int, end: int, block_size: int,
    ) -> None:
        """Cache a request's blocks `start` to `end` (full ones), and record the run of them
        newly cached as one BlockStored, with its parent's hash and its tokens."""
        stored = [i for i in range(start, end) if self.cache(blocks[i], hashes[i])]
        if self.events is None or not stored:
            return
        first, last = stored[0], stored[-1] + 1
        self.events.append(BlockStored(
            block_hashes=[external(hashes[i]) for i in stored],
            parent_block_hash=external(hashes[first - 1]) if first else None,
            token_ids=list(token_ids[first * block_size : last * block_size]),
            block_size=block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
        ))

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: every hash dropped, if no request holds a block (else
        nothing is done: False)."""
        if len(self._free) != self.num_gpu_blocks - 1:
            return False
        for blocks in self._cached.values():
            for block in blocks.values():
                block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (none while events are off)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        entries = self._cached[block.block_hash]
        del entries[block.block_id]
        if not entries:
            del self._cached[block.block_hash]
        if self.events is not None:
            self.events.append(BlockRemoved(block_hashes=[external(block.block_hash)],
                                            medium=MEDIUM_GPU))
        block.block_hash = None
        self.evictions += 1
