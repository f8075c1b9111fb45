"""What the rules changed: edits, bytes and estimated tokens per rule, values moved per pattern."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

Body = dict[str, Any]  # a request body; rules treat it as immutable and copy what they change

# Tokens are estimated from bytes (about 4 bytes per token for English prose in cl100k-like
# vocabularies): the figure is for a dashboard, not for anyone's bill.
BYTES_PER_TOKEN = 4


@dataclass(slots=True)
class Tally:
    """Filled in by the rules of one normalization."""

    edits: Counter[str] = field(default_factory=Counter)  # per rule: texts or items changed
    changed: Counter[str] = field(default_factory=Counter)  # per rule: bytes changed
    moved: Counter[str] = field(default_factory=Counter)  # per relocation pattern: values moved

    def add(self, rule: str, edits: int, changed_bytes: int) -> None:
        self.edits[rule] += edits
        self.changed[rule] += changed_bytes


def estimated_tokens(changed_bytes: int) -> int:
    return -(-changed_bytes // BYTES_PER_TOKEN)


def changed_bytes(before: str, after: str) -> int:
    """How much of a text changed, in UTF-8 bytes: the bytes removed or added (most rules
    only delete), or, when the size stays the same (keys reordered), the span that differs —
    what lies between the common beginning and the common end."""
    if before == after:
        return 0
    grown = len(after.encode()) - len(before.encode())
    if grown:
        return abs(grown)
    start = _common_prefix(before, after)
    end = _common_suffix(before[start:], after[start:])
    return max(len(before[start:len(before) - end].encode()),
               len(after[start:len(after) - end].encode()))


def _common_prefix(a: str, b: str) -> int:
    low, high = 0, min(len(a), len(b))
    while low < high:  # binary search on slice equality: compares run at C speed
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _common_suffix(a: str, b: str) -> int:
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[len(a) - middle:] == b[len(b) - middle:]:
            low = middle
        else:
            high = middle - 1
    return low
