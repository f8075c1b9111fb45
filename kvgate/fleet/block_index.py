"""One replica's cache as vLLM's KV cache events describe it (`kvgate.fleet.kv_wire` decodes
them): an index of the blocks they say the replica holds, keyed by content. Pure: no clock,
no I/O (`kvgate.fleet.kv_events` reads the events off the replicas' sockets).

- `BlockIndex` is one replica's cache. The engine's block hashes are opaque ids: each block
  is keyed by its content, its token ids chained from its parent's key (`block_keys`, which
  a request's own tokens are keyed by too: `LazyKeys`), so the key does not depend on vLLM's
  hash seed or algorithm. It is bounded by the replica's own capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvgate.fleet.kv_wire import Event

if TYPE_CHECKING:
    from kvgate.fleet.engine_hash import EngineHashes

ROOT_KEY = 0  # the parent key of a prompt's first block
# The content key of a block whose chain began before the index did (its parent unknown, or
# itself such a block): held under its engine hash alone. Python's hash() is never -1.
ORPHAN_KEY = -1
def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """The content key of one block: its tokens, after its parent's key. (Python's hash of a
    tuple of ints is the same in every process: no hash randomization for ints.)"""
    return hash((parent, tuple(tokens)))


def block_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """The content key of every full block of `token_ids`, chained from `parent`'s."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


class LazyKeys:
    """A prompt's block keys (`block_keys`), made only as far as some replica holds them: a
    long prompt that no replica holds past its system prompt costs a few hashes, not one per
    block. Its blocks' engine digests (`kvgate.fleet.engine_hash`) likewise, where asked."""

    __slots__ = ("_digests", "_hashes", "_keys", "size", "tokens")

    def __init__(self, token_ids: Sequence[int], block_size: int) -> None:
        self.tokens, self.size = token_ids, block_size
        self._keys: list[int] = []
        self._digests: list[bytes] = []
        self._hashes: EngineHashes | None = None  # whose digests those are

    @property
    def blocks(self) -> int:
        """How many full blocks the prompt has."""
        return len(self.tokens) // self.size

    @property
    def hashed(self) -> int:
        """How many of its blocks' engine digests have been made."""
        return len(self._digests)

    def digests(self, hashes: EngineHashes, blocks: int) -> list[bytes]:
        """The engine's digests of the prompt's first `blocks` full blocks, by `hashes`."""
        if self._hashes is not hashes:
            self._hashes, self._digests = hashes, []
        out, size, tokens = self._digests, self.size, self.tokens
        while len(out) < min(blocks, self.blocks):
            start = len(out) * size
            out.append(hashes.chain(out[-1] if out else None, tokens[start : start + size]))
        return out[:blocks]

    def leading(self, holds: Callable[[int], bool]) -> int:
        """How many of the prompt's leading blocks are held, by `holds(key)`."""
        count = 0
        while self._made(count + 1) > count and holds(self._keys[count]):
            count += 1
        return count

    def first(self, blocks: int) -> list[int]:
        """The keys of the prompt's first `blocks` full blocks (fewer if it has fewer)."""
        return self._keys[: self._made(blocks)]

    def _made(self, blocks: int) -> int:
        """Make keys up to `blocks` of them; how many there are."""
        keys, size, tokens = self._keys, self.size, self.tokens
        while len(keys) < blocks and (len(keys) + 1) * size <= len(tokens):
            start = len(keys) * size
            keys.append(chain_key(keys[-1] if keys else ROOT_KEY, tokens[start : start + size]))
        return min(blocks, len(keys))


class BlockIndex:
    """One replica's cached blocks, as its events say: each engine hash's content key, held
    once per stored block (a hash stored twice is removed twice), oldest first, at most
    `capacity` hashes (the replica's own blocks)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # engine hash -> content key, oldest first; plain dicts of ints (this runs for every
        # block a replica stores, thousands a second, and ints are no work for the GC)
        self._keys: dict[Hashable, int] = {}
        self._extra: dict[Hashable, int] = {}  # a hash stored more than once: how many more
        self._held: dict[int, int] = {}  # content key -> engine hashes holding it
        self.orphans = 0  # stored blocks whose content key could not be known (`ORPHAN_KEY`)

    def __len__(self) -> int:
        """The blocks held, by engine hash."""
        return len(self._keys)

    def apply(self, event: Event) -> list[int]:
        """Apply the event; the content keys a removal left held by no block."""
        if event.kind == "stored":
            self._store(event)
        elif event.kind == "removed":
            gone = [key for block_hash in event.hashes
                    if (key := self._remove(block_hash)) is not None]  # fmt: skip
            return gone
        elif event.kind == "cleared":
            self.clear()
        return []

    def _store(self, event: Event) -> None:
        keys, held = self._keys, self._held
        if event.parent is None:
            parent = ROOT_KEY
        elif (known := keys.get(event.parent)) is not None:
            parent = known
        else:  # its chain began before the index did: its content key cannot be known, but
            # its engine hash can match, and vLLM stores a block only under a cached parent
            parent = ORPHAN_KEY
            keys[event.parent] = ORPHAN_KEY
            held[ORPHAN_KEY] = held.get(ORPHAN_KEY, 0) + 1
        tokens, size, salts = event.token_ids, event.block_size, event.salts
        for i, block_hash in enumerate(event.hashes):
            if parent == ORPHAN_KEY:
                self.orphans += 1
            elif salts is None:
                parent = hash((parent, tokens[i * size : (i + 1) * size]))  # chain_key's
            else:  # never a plain prompt's key, and its children chain under it
                parent = hash((parent, tokens[i * size : (i + 1) * size], salts[i]))
            if block_hash in keys:
                self._extra[block_hash] = self._extra.get(block_hash, 0) + 1
            else:
                keys[block_hash] = parent
                held[parent] = held.get(parent, 0) + 1
        if len(keys) > self.capacity:
            self.resize(self.capacity)

    @property
    def partial(self) -> bool:
        """Some blocks are held under their engine hash alone (`ORPHAN_KEY`)."""
        return ORPHAN_KEY in self._held

    def holds_hash(self, block_hash: Hashable) -> bool:
        """The replica holds the block the engine publishes under this hash."""
        return block_hash in self._keys

    def learn(self, hashes: Sequence[Hashable], keys: Sequence[int]) -> None:
        """A prompt's leading blocks, by engine hash and content key, found held below a block
        the index held by its hash alone: vLLM caches a block only under its cached parents,
        and evicts a request's blocks from its last, so those are held too. Each one the
        index lacked, or held by hash alone, is keyed by its content from now on."""
        own, held = self._keys, self._held
        for block_hash, key in zip(hashes, keys, strict=True):
            had = own.get(block_hash)
            if had == key:
                continue
            if had is not None:  # ORPHAN_KEY: now known
                self._unhold(had)
            own[block_hash] = key
            held[key] = held.get(key, 0) + 1
        if len(own) > self.capacity:
            self.resize(self.capacity)

    def _remove(self, block_hash: Hashable) -> int | None:
        """Drop one copy of the block; its content key where no block holds it any more."""
        if block_hash not in self._keys:
            return None
        extra = self._extra.get(block_hash)
        if extra:
            if extra > 1:
                self._extra[block_hash] = extra - 1
            else:
                del self._extra[block_hash]
            return None
        key = self._keys.pop(block_hash)
        return key if self._unhold(key) else None

    def _unhold(self, key: int) -> bool:
        """One block fewer holds `key`; whether none does now."""
        left = self._held[key] - 1
        if left > 0:
            self._held[key] = left
            return False
        del self._held[key]
        return True

    def resize(self, capacity: int) -> None:
        """Bound the index at `capacity` blocks from now on, the oldest going first."""
        self.capacity = capacity
        keys = self._keys
        while len(keys) > capacity:
            oldest = next(iter(keys))
            self._extra.pop(oldest, None)
            self._unhold(keys.pop(oldest))

    def clear(self) -> None:
        self._keys.clear()
        self._extra.clear()
        self._held.clear()

    def holds(self, key: int) -> bool:
        return key in self._held

    def keys(self) -> frozenset[int]:
        """Every content key held."""
        return frozenset(self._held)

    def leading(self, keys: Iterable[int]) -> int:
        """How many of `keys`, from the first, the replica holds."""
        count = 0
        for key in keys:
            if key not in self._held:
                break
            count += 1
        return count
