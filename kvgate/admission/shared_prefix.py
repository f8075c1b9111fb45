"""Shared prefixes on the block ledger: the blocks of a common prompt prefix are reserved once
per replica, not once per request.

vLLM's prefix cache stores a prefix's full blocks once and every running request that starts
with the same tokens uses them. Charging each request the whole prompt would make kvgate admit
far fewer requests than fit (a 400-token system prompt shared by 30 chats is 25 blocks, not
750). So the first request with a given prefix on a replica reserves the prefix's blocks as a
lease of their own, later requests reserve only the rest, and the prefix lease is released
when the last request using it ends. Only a prefix whose lease is already granted gives
credit; while it is being acquired, others reserve in full. The credit is conservative: full
blocks only, minus one for chat-template differences at the boundary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class SharedPrefix:
    replica_id: str
    key: str
    blocks: int
    lease_id: str = field(default_factory=lambda: f"prefix-{os.urandom(12).hex()}")
    refs: int = 0
    live: bool = False  # its lease has been granted


def credit_blocks(prefix_tokens: int, block_size: int) -> int:
    """Blocks of a prefix that are certainly shared: the full ones, less one for the template."""
    return max(0, prefix_tokens // block_size - 1)


class SharedPrefixes:
    """This instance's shared-prefix leases, by (replica, prefix key), with the live blocks
    per replica kept as they change (every fleet snapshot reads them for every replica: a
    scan of all entries per replica would grow with replicas × prefixes)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], SharedPrefix] = {}
        self._held: dict[str, int] = {}  # replica id -> blocks of its live entries

    def get(self, replica_id: str, key: str) -> SharedPrefix | None:
        return self._entries.get((replica_id, key))

    def open(self, replica_id: str, key: str, blocks: int) -> SharedPrefix:
        entry = SharedPrefix(replica_id, key, blocks, refs=1)
        self._entries[(replica_id, key)] = entry
        return entry

    def granted(self, entry: SharedPrefix) -> None:
        """The entry's lease was granted: its blocks count as held (and give credit)."""
        if not entry.live and self._entries.get((entry.replica_id, entry.key)) is entry:
            entry.live = True
            self._held[entry.replica_id] = self._held.get(entry.replica_id, 0) + entry.blocks

    def drop(self, entry: SharedPrefix) -> None:
        if self._entries.get((entry.replica_id, entry.key)) is not entry:
            return
        del self._entries[(entry.replica_id, entry.key)]
        if entry.live:
            held = self._held.get(entry.replica_id, 0) - entry.blocks
            if held > 0:
                self._held[entry.replica_id] = held
            else:
                self._held.pop(entry.replica_id, None)

    def held_blocks(self, replica_id: str) -> int:
        return self._held.get(replica_id, 0)

    def __len__(self) -> int:
        return len(self._entries)
