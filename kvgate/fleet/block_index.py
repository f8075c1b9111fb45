"""One replica's cache as vLLM's KV cache events describe it: the events decoded, and an index
of the blocks they say the replica holds, keyed by content. Pure: no clock, no I/O
(`kvgate.fleet.kv_events` reads the events off the replicas' sockets).

- `decode_batch` reads a batch in either encoding producers use: events as tagged maps
  (vLLM's msgspec structs today) or as arrays led by the tag (earlier producers).
- `BlockIndex` is one replica's cache. The engine's block hashes are opaque ids: each block
  is keyed by its content, its token ids chained from its parent's key (`block_keys`, which
  a request's own tokens are keyed by too: `LazyKeys`), so the key does not depend on vLLM's
  hash seed or algorithm. It is bounded by the replica's own capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import msgspec

if TYPE_CHECKING:
    from kvgate.fleet.engine_hash import EngineHashes

ROOT_KEY = 0  # the parent key of a prompt's first block
# The content key of a block whose chain began before the index did (its parent unknown, or
# itself such a block): held under its engine hash alone. Python's hash() is never -1.
ORPHAN_KEY = -1
# The fields of each event, in vLLM's order: an array-encoded event lists them after its tag.
FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
KINDS = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}
# Where a block lives: the index follows the GPU's prefix cache (a tier an offloading
# connector publishes, CPU or storage, is another cache), and the first KV cache group (a
# hybrid model publishes each group's blocks under their own hashes).
INDEXED_MEDIA = (None, "GPU")
INDEXED_GROUPS = (None, 0)


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


class Event(NamedTuple):
    """`elsewhere`: blocks of another tier or KV cache group (not indexed). `salts`: per
    block, what besides its tokens vLLM hashed it with (a LoRA adapter, a cache salt,
    multimodal inputs), None for plain blocks: a salted block never matches a prompt's
    plain keys."""

    kind: Literal["stored", "removed", "cleared", "elsewhere"]
    hashes: tuple[Hashable, ...] = ()
    parent: Hashable | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    salts: tuple[Hashable, ...] | None = None


class Batch(NamedTuple):
    ts: float
    events: list[Event]
    unknown: int  # events of a kind this reader does not know (skipped)


class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    """vLLM's encoding today, the fields this reader needs (others are skipped)."""

    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


class _StoredArray(_Stored, array_like=True, tag="BlockStored"):
    pass


class _RemovedArray(_Removed, array_like=True, tag="BlockRemoved"):
    pass


class _ClearedArray(_Cleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _BatchOfArrays(msgspec.Struct, array_like=True):
    """Earlier vLLM's encoding (0.10, which deploy/k8s pins): each event an array led by its
    tag, its trailing defaults left out."""

    ts: float
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    data_parallel_rank: int | None = None


# Both layouts decode typed, in C: most of what the subscriber costs. Each stream keeps to
# one, so the other's decoder fails at its first event, cheaply.
_DECODERS = (msgspec.msgpack.Decoder(_Batch).decode, msgspec.msgpack.Decoder(_BatchOfArrays).decode)


def decode_batch(payload: bytes) -> Batch:
    """One published batch: an array (ts, events[, data_parallel_rank]) or a map, its events
    as tagged maps or as arrays led by their tag. Raises ValueError on anything else."""
    for decode in _DECODERS:
        try:
            batch: _Batch | _BatchOfArrays = decode(payload)
            break
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    else:
        return _decode_any(payload)
    events = []
    for item in batch.events:  # the array structs are the map structs' subclasses
        if isinstance(item, _Stored):
            if item.block_size < 1 or len(item.token_ids) != item.block_size * len(
                item.block_hashes
            ):
                raise ValueError("BlockStored: token_ids must fill its blocks")
            if item.medium not in INDEXED_MEDIA or item.group_idx not in INDEXED_GROUPS:
                events.append(Event("elsewhere"))
                continue
            events.append(Event(
                "stored", tuple(item.block_hashes), item.parent_block_hash,
                tuple(item.token_ids), item.block_size,
                _salts(item.lora_name or item.lora_id, item.extra_keys, len(item.block_hashes)),
            ))
        elif isinstance(item, _Removed):
            if item.medium not in INDEXED_MEDIA or item.group_idx not in INDEXED_GROUPS:
                events.append(Event("elsewhere"))
            else:
                events.append(Event("removed", tuple(item.block_hashes)))
        else:
            events.append(Event("cleared"))
    return Batch(batch.ts, events, 0)


def _salts(lora: Any, extra_keys: Any, blocks: int) -> tuple[Hashable, ...] | None:
    """Per block, what vLLM hashed it with besides its tokens (its adapter, and the block's
    extra keys: one per block, as vLLM sends them, else the whole list for each); None where
    every block is plain."""
    if lora is None and not extra_keys:  # nearly every block: decided without a list
        return None
    if isinstance(extra_keys, list) and len(extra_keys) == blocks:
        keys = extra_keys
    else:
        keys = [extra_keys or None] * blocks
    if lora is None and all(k is None for k in keys):
        return None
    return tuple((lora, _frozen(k)) for k in keys)


def _frozen(value: Any) -> Hashable:
    """A msgpack value as something hashable (its lists as tuples)."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value if isinstance(value, Hashable) else repr(value)


def _decode_any(payload: bytes) -> Batch:
    """Any encoding: maps or arrays, unknown kinds counted and skipped."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, items = raw.get("ts"), raw.get("events")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, items = raw[0], raw[1]
    else:
        raise ValueError("a batch is (ts, events)")
    if not isinstance(ts, int | float) or not isinstance(items, list):
        raise ValueError("a batch is (ts, events)")
    events, unknown = [], 0
    for item in items:
        if isinstance(item, dict):
            tag, values = item.get("type"), item
        elif isinstance(item, list) and item:
            tag = item[0]
            values = dict(zip(FIELDS.get(tag, ()), item[1:], strict=False))
        else:
            raise ValueError(f"an event is a map or an array, not {type(item).__name__}")
        if tag not in FIELDS:
            unknown += 1
            continue
        events.append(_event(tag, values))
    return Batch(float(ts), events, unknown)


def _event(tag: str, values: dict[str, Any]) -> Event:
    kind = KINDS[tag]
    if kind == "cleared":
        return Event("cleared")
    hashes = values.get("block_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, int | bytes) for h in hashes):
        raise ValueError(f"{tag}: block_hashes must be a list of ids")
    if values.get("medium") not in INDEXED_MEDIA or values.get("group_idx") not in INDEXED_GROUPS:
        return Event("elsewhere")
    if kind == "removed":
        return Event("removed", tuple(hashes))
    tokens, size = values.get("token_ids"), values.get("block_size")
    if not isinstance(size, int) or size < 1 or not isinstance(tokens, list):
        raise ValueError("BlockStored: token_ids and a block_size are required")
    if len(tokens) != size * len(hashes):
        raise ValueError("BlockStored: token_ids must fill its blocks")
    parent = values.get("parent_block_hash")
    lora = values.get("lora_name") or values.get("lora_id")
    salts = _salts(lora, values.get("extra_keys"), len(hashes))
    return Event("stored", tuple(hashes), parent, tuple(tokens), size, salts)


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
