"""Seeded log-probabilities for the filler output, in the two shapes vLLM returns them.

The simulated model is sure of nothing in particular: token i of sequence j gets a logprob
drawn once per seed from a table (so values repeat across runs and replicas with one seed),
and its alternatives are other one-token words, each less likely than the token sampled.
Sequence j reads the table at an offset, so the sequences of one prompt differ in likelihood
and `best_of` has something to rank.

    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}
    completions  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

In chat, `top_logprobs` lists k entries, the sampled token first; in completions each dict
holds the sampled token and k alternatives (vLLM returns k + 1, as the OpenAI spec says).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from kvgate.sim.options import MAX_LOGPROBS

# Words the model "considered": one cl100k token each, all distinct.
ALTERNATIVES: tuple[str, ...] = (
    " the", " model", " served", " a", " request", " from", " pool", " of", " tokens",
    " in", " each", " step", " with", " data", " for", " cache", " block", ".",
    " answer", " system", " value", " queue", " token", " batch", " prefix", " memory",
)  # fmt: skip
PERIOD = 251  # table slots; prime, so sequence offsets do not line up
SEQUENCE_STRIDE = 37


class LogprobTable:
    """Per-seed logprobs of the sampled tokens and the gaps down to their alternatives."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(f"kvgate-sim-logprobs-{seed}")
        self._sampled = tuple(-rng.uniform(0.0005, 2.5) for _ in range(PERIOD))
        self._gaps = tuple(
            tuple(accumulate(rng.uniform(0.05, 1.5) for _ in range(MAX_LOGPROBS)))
            for _ in range(PERIOD)
        )
        self._first_alternative = tuple(rng.randrange(len(ALTERNATIVES)) for _ in range(PERIOD))

    def logprob(self, sequence: int, i: int) -> float:
        """The logprob of output token i of a prompt's sequence `sequence` (always < 0)."""
        return self._sampled[(i + sequence * SEQUENCE_STRIDE) % PERIOD]

    def cumulative(self, sequence: int, count: int) -> float:
        return sum(self.logprob(sequence, i) for i in range(count))

    def alternatives(
        self, sequence: int, i: int, sampled: str, k: int
    ) -> list[tuple[str, float]]:
        """k other words, most likely first, each less likely than the sampled token."""
        slot = (i + sequence * SEQUENCE_STRIDE) % PERIOD
        base, gaps, first = self._sampled[slot], self._gaps[slot], self._first_alternative[slot]
        n = len(ALTERNATIVES)
        words = (ALTERNATIVES[(first + m) % n] for m in range(n))
        chosen = [w for w in words if w != sampled][:k]
        return [(word, base - gap) for word, gap in zip(chosen, gaps, strict=False)]


def chat_logprobs(
    table: LogprobTable, sequence: int, start: int, pieces: Sequence[str], top: int
) -> dict[str, Any]:
    """Chat's `logprobs` for output tokens start .. start+len(pieces)-1, whose texts are
    `pieces`; `top` is the request's top_logprobs."""
    content = []
    for offset, piece in enumerate(pieces):
        i = start + offset
        logprob = table.logprob(sequence, i)
        entries = ([(piece, logprob), *table.alternatives(sequence, i, piece, top - 1)]
                   if top else [])  # fmt: skip
        content.append(
            {
                "token": piece,
                "logprob": logprob,
                "bytes": list(piece.encode()),
                "top_logprobs": [
                    {"token": word, "logprob": value, "bytes": list(word.encode())}
                    for word, value in entries
                ],
            }
        )
    return {"content": content}


def text_logprobs(
    table: LogprobTable,
    sequence: int,
    start: int,
    pieces: Sequence[str],
    top: int,
    text_offset: int,
) -> dict[str, Any]:
    """Completions' `logprobs` for output tokens start .. start+len(pieces)-1; `text_offset`
    is where the first piece starts in the choice's text."""
    logprobs = [table.logprob(sequence, start + offset) for offset in range(len(pieces))]
    offsets = list(accumulate((len(p) for p in pieces[:-1]), initial=text_offset))
    return {
        "tokens": list(pieces),
        "token_logprobs": logprobs,
        "top_logprobs": [
            {piece: logprob, **dict(table.alternatives(sequence, start + offset, piece, top))}
            for offset, (piece, logprob) in enumerate(zip(pieces, logprobs, strict=True))
        ],
        "text_offset": offsets if pieces else [],
    }
