"""How long an answer is likely to be, from the answers of requests shaped like it.

Real answers use a small fraction of `max_tokens` (a few hundred tokens of a 4,096 allowance
is typical), so reserving the allowance idles most of the blocks it holds. Admission in
`predicted` mode reserves what the answer is likely to need instead, and grows the reservation
if the answer outruns it (`kvgate.admission.demand.growth_target`).

What predicts an answer's length is the request's `Shape`: who asks (tenant), what (model,
endpoint, tools or a response format), with what allowance (`max_tokens`, bucketed by powers
of two; omitted is a bucket of its own) and how long a prompt (bucketed the same way: on
Azure's production conversation trace the p95 answer is 145 tokens for prompts of 257–512
tokens and 531 for 1,025–2,048). Each completion is filed under every `LEVELS` key of its
shape, from the exact shape to the whole fleet; a prediction reads the most specific key with
at least `min_samples` answers, so a shape with too little history borrows from its
neighbours (other prompt lengths, other tenants, the model, the fleet) and, with none at all,
from the configured `prior_tokens`.

What a request itself says beats any history: `ignore_eos` writes all of `max_tokens`, and
`min_tokens` at least that many (`answer_floor`).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ANY = "*"
OPEN = -1  # the bucket of a request that sent no max_tokens


def bucket(tokens: int | None) -> int:
    """Powers of two: 1–64 → 6, 65–128 → 7, ..., None → OPEN."""
    if tokens is None:
        return OPEN
    return max(6, math.ceil(math.log2(max(1, tokens))))


@dataclass(frozen=True, slots=True)
class Shape:
    """What predicts an answer's length, as the request says it."""

    tenant: str
    model: str
    endpoint: str  # "chat" or "completions"
    budget: int  # bucket(max_tokens as the client sent it)
    prompt: int  # bucket(prompt tokens of one sequence)
    structured: bool  # tools or a response_format

    @classmethod
    def of(
        cls, tenant: str, model: str, endpoint: str, body: Mapping[str, Any],
        max_tokens: int | None, prompt_tokens: int,
    ) -> Shape:
        structured = bool(body.get("tools")) or body.get("response_format") is not None
        return cls(tenant, model, endpoint, bucket(max_tokens), bucket(prompt_tokens), structured)


# From the exact shape to the whole fleet: each a function of the shape to a history key.
LEVELS: tuple[tuple[str, Callable[[Shape], tuple[object, ...]]], ...] = (
    ("shape", lambda s: (s.tenant, s.model, s.endpoint, s.budget, s.prompt, s.structured)),
    ("shape_any_tenant", lambda s: (ANY, s.model, s.endpoint, s.budget, s.prompt, s.structured)),
    ("tenant_budget", lambda s: (s.tenant, s.model, s.endpoint, s.budget, ANY, s.structured)),
    ("budget", lambda s: (ANY, s.model, s.endpoint, s.budget, ANY, ANY)),
    ("model", lambda s: (ANY, s.model, ANY, ANY, ANY, ANY)),
    ("fleet", lambda s: (ANY, ANY, ANY, ANY, ANY, ANY)),
)
SOURCES = (*(name for name, _ in LEVELS), "prior")


class Lengths:
    """The last `window` answer lengths of one key, kept sorted, with their running sum."""

    __slots__ = ("_reads", "_recent", "_sorted", "_tails", "_window")

    def __init__(self, window: int) -> None:
        self._window = window
        self._recent: deque[int] = deque()
        self._sorted: list[int] = []
        # _tails[i] = sum(_sorted[i:]), made on the second read after a change: the ledger
        # reads every running answer's forecast several times a second, while under a steady
        # arrival of requests every answer changes the window before the next one reads it
        self._tails: list[int] | None = None
        self._reads = 0  # since the last change

    def __len__(self) -> int:
        return len(self._sorted)

    def add(self, tokens: int) -> None:
        if len(self._recent) >= self._window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(tokens)
        bisect.insort(self._sorted, tokens)
        self._tails, self._reads = None, 0

    def quantile(self, q: float) -> int:
        ordered = self._sorted
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def count_above(self, tokens: int) -> int:
        """How many of the known answers were longer than `tokens`."""
        return len(self._sorted) - bisect.bisect_right(self._sorted, tokens)

    def mean_above(self, written: int) -> float | None:
        """E[length | length > written] over the window: the survival curve's expectation of
        an answer that has written `written` tokens; None when none was that long."""
        ordered = self._sorted
        first = bisect.bisect_right(ordered, written)
        if first == len(ordered):
            return None
        if self._tails is None:
            self._reads += 1
            if self._reads < 2:
                return sum(ordered[first:]) / (len(ordered) - first)
            self._tails = list(itertools.accumulate(reversed(ordered)))[::-1]
        return self._tails[first] / (len(ordered) - first)


@dataclass(frozen=True, slots=True)
class Prediction:
    """One request's answer length, per sequence: its history (None: only the prior is
    known), the floor the request forces, and its allowance."""

    history: Lengths | None
    source: str  # which level answered (SOURCES)
    floor: int  # what the request must write (ignore_eos, min_tokens)
    max_tokens: int
    prior: int

    def likely(self, quantile: float) -> int:
        """A high quantile of the answer's length: at least its floor, at most max_tokens."""
        seen = self.prior if self.history is None else self.history.quantile(quantile)
        return min(self.max_tokens, max(1, self.floor, seen))

    def expected(self, written: int = 0) -> int:
        """The length an answer that has written `written` tokens is expected to reach:
        the mean of the known answers longer than that (at least its floor, at most
        max_tokens); past every known answer, `written` itself (the caller adds a margin)."""
        if self.history is None:
            seen: float | None = self.prior if self.prior > written else None
        else:
            seen = self.history.mean_above(written)
        expected = written if seen is None else math.ceil(seen)
        return min(self.max_tokens, max(1, self.floor, written, expected))

    def surviving(self, written: int, more: int) -> float:
        """The chance that an answer that has written `written` tokens writes `more` more:
        the share of the known answers longer than `written` that were longer than
        `written + more` too (1 below its floor, 0 from max_tokens on; past every known
        answer, 0: it is expected to end now, as `expected` says). Without history, the
        prior is taken as every answer's length."""
        reach = written + more
        if reach < self.floor:
            return 1.0
        if reach >= self.max_tokens:
            return 0.0
        if self.history is None:
            return 1.0 if reach < self.prior else 0.0
        alive = self.history.count_above(written)
        return self.history.count_above(reach) / alive if alive else 0.0


class LengthModel:
    """Answer lengths by shape, at every level of `LEVELS`, the last `window` of each."""

    def __init__(self, window: int = 256) -> None:
        self.window = window
        self._history: dict[tuple[object, ...], Lengths] = {}

    def observe(self, shape: Shape, completion_tokens: int) -> None:
        """One sequence's completion length, from vLLM's usage."""
        if completion_tokens < 0:
            return
        for _, key in LEVELS:
            lengths = self._history.get(k := key(shape))
            if lengths is None:
                lengths = self._history[k] = Lengths(self.window)
            lengths.add(completion_tokens)

    def predict(
        self, shape: Shape, max_tokens: int, *, min_samples: int, prior_tokens: int,
        floor: int = 0,
    ) -> Prediction:
        """From the most specific history with `min_samples` answers, else the prior; `floor`:
        what the request forces every sequence to write."""
        for name, key in LEVELS:
            lengths = self._history.get(key(shape))
            if lengths is not None and len(lengths) >= min_samples:
                return Prediction(lengths, name, floor, max_tokens, prior_tokens)
        return Prediction(None, "prior", floor, max_tokens, prior_tokens)


def answer_floor(body: Mapping[str, Any], max_tokens: int) -> int:
    """Tokens the request says every sequence will write whatever the model does:
    `ignore_eos` writes all of max_tokens, `min_tokens` at least that many."""
    if body.get("ignore_eos") is True:
        return max_tokens
    minimum = body.get("min_tokens")
    if isinstance(minimum, int) and not isinstance(minimum, bool) and minimum > 0:
        return min(max_tokens, minimum)
    return 0
