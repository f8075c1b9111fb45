"""Shared prefixes on the block ledger: a block of prompt that several live requests on a
replica begin with is reserved once there, not once per request.

vLLM's prefix cache stores a full block of prompt once, and every running request whose
tokens up to the end of that block are the same uses it. Charging each request its whole
prompt would make kvgate admit far fewer requests than fit: a 400-token system prompt shared
by 30 chats is 25 blocks, not 750, and a 1,500-token document asked about by 13 users is 94
blocks, not 1,222.

A request names the blocks it can share by their keys (`Demand.shared_keys`): with its exact
token ids, every full block but the one holding the prompt's last token, each keyed by its
tokens chained from its parent's (`kvgate.fleet.block_index`), so two prompts share exactly
the blocks vLLM would let them share; without them, the estimated full blocks of its first
message, less one for the chat template's boundary. The keys a replica's live requests use
are counted per replica (`SharedBlocks`): a request there is credited with its leading keys
already counted and reserves the rest, its new keys counted from then on; its keys stop
counting with their last user. The counted blocks are one lease per replica, whose amount
follows their number. A block in use cannot be evicted, so the credit holds for its
requests' lifetime; a block vLLM still caches but no request uses is free in vLLM's own
books, and the next request to use it is charged for it.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


def credit_blocks(prefix_tokens: int, block_size: int) -> int:
    """Blocks of an estimated first message that are certainly shared: the full ones, less
    one for the template."""
    return max(0, prefix_tokens // block_size - 1)


def exact_shared_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full blocks of an exactly known prompt that another request with the same tokens can
    share: all but the one holding its last token, which vLLM computes again (a prompt is
    never taken from the cache whole)."""
    return max(0, prompt_tokens - 1) // block_size


@dataclass(eq=False, slots=True)
class ReplicaShare:
    """The shared blocks of one replica's live requests: how many use each key, the lease that
    holds them (one block per key counted), and the lock its changes go through, one at a
    time, so that the lease's amount in the store follows the count in order."""

    replica_id: str
    lease_id: str = field(default_factory=lambda: f"shared-{os.urandom(12).hex()}")
    refs: Counter[Hashable] = field(default_factory=Counter)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def held(self) -> int:
        """Blocks counted: one per key some live request uses."""
        return len(self.refs)

    def credit(self, keys: Sequence[Hashable]) -> int:
        """How many of `keys`' leading blocks are counted here already. (The counted keys
        are closed under prefixes: a request counts all its leading keys, and a key stands
        for every token before it.)"""
        count, refs = 0, self.refs
        for key in keys:
            if key not in refs:
                break
            count += 1
        return count

    def add(self, keys: Sequence[Hashable]) -> None:
        self.refs.update(keys)

    def remove(self, keys: Sequence[Hashable]) -> int:
        """The request's keys stop counting; how many blocks no request uses any more."""
        refs, before = self.refs, len(self.refs)
        for key in keys:
            left = refs[key] - 1
            if left > 0:
                refs[key] = left
            else:
                del refs[key]
        return before - len(refs)


@dataclass(eq=False, slots=True)
class SharedUse:
    """One request's use of a replica's shared blocks: the keys it counts there."""

    share: ReplicaShare
    keys: Sequence[Hashable]

    @property
    def blocks(self) -> int:
        return len(self.keys)


class SharedBlocks:
    """This instance's shared blocks, per replica."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaShare] = {}

    def of(self, replica_id: str) -> ReplicaShare:
        share = self._replicas.get(replica_id)
        if share is None:
            share = self._replicas[replica_id] = ReplicaShare(replica_id)
        return share

    def forget(self, keep: set[str]) -> None:
        """Drop the entries of replicas no longer in the fleet that nothing uses. (A request
        keeps its entry through its `SharedUse`, whatever happens to the table.)"""
        for replica_id in [r for r in self._replicas if r not in keep]:
            share = self._replicas[replica_id]
            if not share.refs and not share.lock.locked():
                del self._replicas[replica_id]

    def held_blocks(self, replica_id: str) -> int:
        share = self._replicas.get(replica_id)
        return 0 if share is None else share.held

    def __len__(self) -> int:
        """Replicas where some request uses shared blocks."""
        return sum(1 for share in self._replicas.values() if share.refs)
