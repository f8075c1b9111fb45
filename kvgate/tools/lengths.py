"""Observed request lengths: read from a file, summarized in nearest-rank percentiles.

`read_lengths` takes one integer per line, a CSV with `prompt_tokens` and `completion_tokens`
columns, or JSONL objects with those keys; `length_stats` gives what `kvgate plan` sizes by.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path


@dataclass(frozen=True)
class LengthStats:
    """Observed total lengths (prompt + completion tokens), nearest-rank percentiles."""

    count: int
    p50: int
    p99: int
    p999: int
    max: int




def percentile(sorted_values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile of a non-empty ascending sequence, q in (0, 100]."""
    # Fraction(str(q)): 99.9 / 100 * 1000 is 999.0000000000001 in binary floating point.
    rank = max(1, math.ceil(Fraction(str(q)) * len(sorted_values) / 100))
    return sorted_values[rank - 1]


def length_stats(lengths: Sequence[int]) -> LengthStats:
    ordered = sorted(lengths)
    return LengthStats(
        count=len(ordered),
        p50=percentile(ordered, 50),
        p99=percentile(ordered, 99),
        p999=percentile(ordered, 99.9),
        max=ordered[-1],
    )



def read_lengths(path: Path) -> tuple[int, ...]:
    """Total lengths from one integer per line, a CSV with a header naming `prompt_tokens`
    and `completion_tokens`, or JSONL objects with those keys. Blank and `#` lines are skipped.
    ValueError naming the file and line on anything else."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a text file") from exc
    rows = [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not rows:
        raise ValueError(f"{path}: no lengths found")
    first = rows[0][1]
    if first.startswith("{"):
        parsed = _jsonl_lengths(rows)
    elif "," in first:
        parsed = _csv_lengths(rows)
    else:
        parsed = _integer_lengths(rows)
    lengths = []
    try:
        for number, value in parsed:
            if value <= 0:
                raise ValueError(f"line {number}: a total length must be > 0, got {value}")
            lengths.append(value)
    except (ValueError, csv.Error) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not lengths:
        raise ValueError(f"{path}: no lengths found")
    return tuple(lengths)


def _integer_lengths(rows: list[tuple[int, str]]) -> Iterator[tuple[int, int]]:
    for number, line in rows:
        try:
            yield number, int(line)
        except ValueError:
            raise ValueError(f"line {number}: expected an integer, got {line[:40]!r}") from None


def _csv_lengths(rows: list[tuple[int, str]]) -> Iterator[tuple[int, int]]:
    reader = csv.reader(line for _, line in rows)
    header = [name.strip() for name in next(reader)]
    missing = {"prompt_tokens", "completion_tokens"} - set(header)
    if missing:
        raise ValueError(
            f"line {rows[0][0]}: CSV header lacks {', '.join(sorted(missing))} "
            f"(got {', '.join(header)})"
        )
    prompt, completion = header.index("prompt_tokens"), header.index("completion_tokens")
    for (number, _), cells in zip(rows[1:], reader, strict=True):
        try:
            yield number, int(cells[prompt]) + int(cells[completion])
        except (ValueError, IndexError):
            raise ValueError(
                f"line {number}: expected integer prompt_tokens and completion_tokens"
            ) from None


def _jsonl_lengths(rows: list[tuple[int, str]]) -> Iterator[tuple[int, int]]:
    for number, line in rows:
        try:
            record = json.loads(line)
            prompt, completion = record["prompt_tokens"], record["completion_tokens"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                f"line {number}: expected a JSON object with prompt_tokens and completion_tokens"
            ) from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (prompt, completion)):
            raise ValueError(f"line {number}: prompt_tokens and completion_tokens must be integers")
        yield number, prompt + completion

