"""vLLM's own block hashes, computed by kvgate from a prompt's token ids.

vLLM keys each full block of a prompt by a hash of (its parent's hash, its token ids, its
extra keys), chained from a first parent, NONE_HASH, that is the hash of a seed. For its
cryptographic algorithms (`--prefix-caching-hash-algo sha256`, the default, or
`sha256_cbor`) the seed is fixed (`vllm-none-hash`) unless PYTHONHASHSEED is set, in which
case that is the seed; so every process that knows the algorithm and the seed computes the
engine's hashes, as llm-d's KV cache manager does. Its KV events publish each hash as the
low 64 bits of the digest, as an int (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, on by default),
or the digest itself.

With the engine's hashes a block's key needs no parent: a block stored under a prefix that
was cached before kvgate subscribed (after a kvgate restart, past the engine's replay
buffer) still matches a request's own hashes, where the content chain (`block_index.
chain_key`) cannot key it. kvgate never takes the hashing on trust: a replica's first
stored root block (no parent) is hashed here and compared (`EngineHashes.verify`); until one
agrees the content chain alone is used.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import pickle
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kvgate.fleet.block_index import BlockIndex, LazyKeys

log = logging.getLogger(__name__)

Algorithm = Literal["sha256", "sha256_cbor"]
DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed where PYTHONHASHSEED is not set
LOW_64 = (1 << 64) - 1


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only where an operator chose this algorithm

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


HASH_FUNCTIONS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def published(digest: bytes, ints: bool = True) -> Hashable:
    """A block's digest as the engine's events publish it: its low 64 bits as an int, or
    the digest itself (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    return int.from_bytes(digest, "big") & LOW_64 if ints else digest


class EngineHashes:
    """One engine's block hashing: its algorithm and seed. `chain` hashes a plain block (no
    LoRA, salt or media: those blocks carry extra keys kvgate does not reproduce, and are
    never matched)."""

    __slots__ = ("_fn", "algorithm", "none_hash", "seed")

    def __init__(self, algorithm: Algorithm = "sha256", seed: str = DEFAULT_SEED) -> None:
        self.algorithm, self.seed = algorithm, seed
        self._fn = HASH_FUNCTIONS[algorithm]
        self.none_hash = self._fn(seed)

    def chain(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        """The digest of a block of `tokens` after `parent`'s (None: the prompt's first)."""
        return self._fn((self.none_hash if parent is None else parent, tuple(tokens), None))

    def block_hashes(
        self, token_ids: Sequence[int], block_size: int, ints: bool = True
    ) -> list[Hashable]:
        """Every full block's hash, as published."""
        out, parent = [], None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = self.chain(parent, token_ids[start : start + block_size])
            out.append(published(parent, ints))
        return out


@functools.cache
def engine_hashes(algorithm: Algorithm, seed: str) -> EngineHashes:
    """The hashing of a pool's engines, one for all of them (a prompt's digests are made once
    for every replica that hashes alike: `LazyKeys.digests`)."""
    return EngineHashes(algorithm, seed)


# How far past its leading held blocks a prompt is hashed, looking for a block held by its
# engine hash alone (a replica's index that began after the prompt's prefix was cached):
# 4,096 tokens at vLLM's block size of 16, about 0.3 ms of hashing, and only while the index
# holds such blocks.
SCAN_BLOCKS = 256


class EngineMatch:
    """Matching one replica's index by the engine's own hashes, beside the content keys.
    `check` compares a root block the replica publishes with the hash computed here: a
    replica that hashes otherwise (another algorithm or seed) is matched by content alone."""

    def __init__(self, hashes: EngineHashes, replica_id: str) -> None:
        self.hashes, self.replica_id = hashes, replica_id
        self.agrees: bool | None = None  # unknown until a root block is compared
        self.ints = True  # the replica publishes hashes as ints (else digests)

    def check(self, value: Hashable, tokens: Sequence[int]) -> None:
        """A root block the replica stored (no parent, no extra keys): its hash as published."""
        if self.agrees is not None:
            return
        self.ints = isinstance(value, int)
        self.agrees = published(self.hashes.chain(None, tokens), self.ints) == value
        if not self.agrees:
            log.warning("replica %s hashes blocks otherwise than kv_events.block_hash (%s) and "
                        "hash_seed say: its blocks are matched by content alone",
                        self.replica_id, self.hashes.algorithm)

    def leading(self, prompt: LazyKeys, index: BlockIndex, holds: Callable[[int], bool]) -> int:
        """The prompt's leading blocks the replica holds: by content key (`holds`), and where
        the index holds blocks by engine hash alone, the deepest of the prompt's blocks it
        holds so (the blocks before it learnt, so that the next prompt finds them cheaply)."""
        count = prompt.leading(holds)
        if self.agrees is False or not index.partial or count >= prompt.blocks:
            return count
        limit = min(prompt.blocks, count + SCAN_BLOCKS)
        digests = prompt.digests(self.hashes, limit)
        ints = self.ints
        deepest = count
        for i in range(count, limit):
            if index.holds_hash(published(digests[i], ints)):
                deepest = i + 1
        if deepest > count:
            index.learn([published(d, ints) for d in digests[:deepest]], prompt.first(deepest))
        return deepest
