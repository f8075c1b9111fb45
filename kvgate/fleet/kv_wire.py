"""vLLM's KV cache events on the wire: a published batch decoded into `Event`s, in either
encoding producers use: events as tagged maps (vLLM's msgspec structs today) or as arrays led
by the tag (vLLM 0.10, and earlier producers), both typed in C; anything else through the
generic msgpack path, kinds this reader does not know counted and skipped. Pure.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Literal, NamedTuple

import msgspec

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


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank `rank` publishes (or serves replays) when `endpoint` is
    configured: at its port + the rank, vLLM's convention (port 0, any free port, stays 0)."""
    base, _, port = endpoint.rpartition(":")
    if rank == 0 or not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + rank}"


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


ELSEWHERE, CLEARED = Event("elsewhere"), Event("cleared")


class Batch(NamedTuple):
    ts: float
    events: list[Event]
    unknown: int  # events of a kind this reader does not know (skipped)


class _Stored(msgspec.Struct, tag="BlockStored"):
    # tuples, decoded as such in C: an `Event` holds them as they are
    block_hashes: tuple[int | bytes, ...]
    parent_block_hash: int | bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: tuple[int | bytes, ...]
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
    events: list[Event] = []
    append = events.append
    for item in batch.events:  # the array structs are the map structs' subclasses
        if isinstance(item, _Stored):
            hashes, tokens, size = item.block_hashes, item.token_ids, item.block_size
            if size < 1 or len(tokens) != size * len(hashes):
                raise ValueError("BlockStored: token_ids must fill its blocks")
            if item.medium not in INDEXED_MEDIA or item.group_idx not in INDEXED_GROUPS:
                append(ELSEWHERE)
            elif item.lora_name is None and item.lora_id is None and not item.extra_keys:
                append(Event("stored", hashes, item.parent_block_hash, tokens, size))
            else:
                lora = item.lora_name or item.lora_id
                salts = _salts(lora, item.extra_keys, len(hashes))
                append(Event("stored", hashes, item.parent_block_hash, tokens, size, salts))
        elif isinstance(item, _Removed):
            if item.medium not in INDEXED_MEDIA or item.group_idx not in INDEXED_GROUPS:
                append(ELSEWHERE)
            else:
                append(Event("removed", item.block_hashes))
        else:
            append(CLEARED)
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
