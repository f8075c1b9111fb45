"""The production trace workloads: Azure's LLM conversation trace, replayed time-compressed.

bench/traces/ holds 2,000 consecutive rows of the trace (their README says which, and its
licence): each an arrival time, the prompt's tokens (ContextTokens) and the answer's
(GeneratedTokens). A run of `duration_s` simulated seconds at `rate` requests per second is:

  * **the trace**, at `rate × (1 - BULK_SHARE)`: the rows from a seeded offset on (the slice
    replays as a loop), their arrival times relative to the first, all multiplied by one
    factor so that their mean rate is the one asked: the trace's bursts and lulls are kept,
    compressed. A seeded `VIP_SHARE` of them are the critical tenant `vip`'s, the rest the
    standard tenant `chat-app`'s, as in the `realistic` workload.
  * **bulk jobs**, at `rate × BULK_SHARE`: the sheddable tenant `batch` sends a burst of
    `BURST` jobs within `BURST_SPREAD_S` every so often (at a seeded phase, then regularly),
    each job a row of the slice drawn at random.
  * **prompts** of exactly ContextTokens as the replicas count them (their ChatML template over
    cl100k): a fixed system prompt (`ASSISTANT_PROMPT`, 205 tokens; a bulk job's
    `EXTRACTION_PROMPT`, 91), as a chat product sends with every conversation, then a user
    message of single-token words; a row too short for the system prompt is the user message
    alone, and a row shorter than the template's smallest prompt gets that (9 tokens).
  * **answers** that end after GeneratedTokens: the header `X-Sim-Output-Tokens` tells the
    simulated model (kvgate.sim.options); no body field forces a length, so a gateway in
    front sees only what a client of the real service sends.
  * **max_tokens** as clients set it, which the trace does not record: `trace` sends 1,024 on
    every request; `trace-mixed` a seeded third each of none, 2,048 and 4,096.

A request is `long` (direct-rr sends it to the long-context replica) when its prompt and
max_tokens reach LONG_POOL_MIN_TOKENS, where kvgate's long pool starts.
"""

from __future__ import annotations

import csv
import functools
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.options import OUTPUT_TOKENS_HEADER
from kvgate.sim.text import PromptEncoder
from kvgate.tools.workload import WorkItem

from .prompts import ASSISTANT_PROMPT, EXTRACTION_PROMPT, chat, words

SLICE = Path(__file__).resolve().parents[1] / "traces" / "azure-llm-inference-2023-conv-slice.csv"
VIP_SHARE = 0.08  # of the trace's requests
BULK_SHARE = 0.15  # of all requests
BURST = (12, 20)  # jobs per bulk burst, uniformly
BURST_SPREAD_S = 1.5  # a burst's jobs arrive within this many simulated seconds
LONG_POOL_MIN_TOKENS = 8192  # the normal replicas' max_model_len
FIXED_MAX_TOKENS = 1024
MIXED_MAX_TOKENS: tuple[int | None, ...] = (None, 2048, 4096)  # None: the body has none


@dataclass(frozen=True, slots=True)
class Row:
    at_s: float  # arrival, seconds after the slice's first
    context_tokens: int
    generated_tokens: int


@functools.cache
def load_slice(path: Path = SLICE) -> tuple[Row, ...]:
    with path.open(newline="") as f:
        raw = [(datetime.fromisoformat(r["TIMESTAMP"]), int(r["ContextTokens"]),
                int(r["GeneratedTokens"])) for r in csv.DictReader(f)]  # fmt: skip
    start = raw[0][0]
    return tuple(Row((t - start).total_seconds(), c, g) for t, c, g in raw)


def replay(rows: Sequence[Row], offset: int, duration_s: float, rate: float,
           ) -> list[tuple[float, Row]]:  # fmt: skip
    """(arrival, row) from row `offset` on, looping, for `duration_s` at a mean of `rate`
    per second: every arrival time relative to the offset row's, times one factor."""
    gap = rows[-1].at_s / (len(rows) - 1)  # the mean; also where the loop joins
    period = rows[-1].at_s + gap
    factor = len(rows) / period / rate
    out: list[tuple[float, Row]] = []
    for k in itertools.count(offset):
        row = rows[k % len(rows)]
        at = (row.at_s + (k // len(rows)) * period - rows[offset].at_s) * factor
        if at >= duration_s:
            break
        out.append((at, row))
    return out


def bursts(rng: random.Random, rows: Sequence[Row], duration_s: float, rate: float,
           ) -> list[tuple[float, Row]]:  # fmt: skip
    """(arrival, row) of bulk jobs: bursts every `sum(BURST) / 2 / rate` seconds."""
    every = sum(BURST) / 2 / rate
    out = []
    start = rng.uniform(0, every)
    while start < duration_s:
        for _ in range(rng.randint(*BURST)):
            at = start + rng.uniform(0, BURST_SPREAD_S)
            if at < duration_s:
                out.append((at, rng.choice(rows)))
        start += every
    return out


@functools.cache
def template_tokens(system: str | None) -> int:
    """Tokens of a chat with this system prompt and an empty user message, as the replicas
    count them: what a prompt of n words adds n tokens to."""
    messages = [{"role": "user", "content": ""}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return len(PromptEncoder(load_tiktoken()).encode_chat(messages))


def prompt(rng: random.Random, context_tokens: int, system: str) -> tuple[str | None, str]:
    """(system prompt or None, user text) of `context_tokens` (at least the smallest chat)."""
    bare = template_tokens(None)
    if context_tokens > template_tokens(system):
        return system, words(rng, context_tokens - template_tokens(system))
    return None, words(rng, max(1, context_tokens - bare))


def build(seed: int, duration_s: float, rate: float, mixed: bool) -> list[WorkItem]:
    """About `rate` requests per simulated second for `duration_s`, sorted by arrival."""
    rows = load_slice()
    trace = replay(rows, random.Random(f"offset {seed}").randrange(len(rows)), duration_s,
                   rate * (1 - BULK_SHARE))  # fmt: skip
    bulk = bursts(random.Random(f"bulk {seed}"), rows, duration_s, rate * BULK_SHARE)
    tenants = random.Random(f"tenants {seed}")
    limits = random.Random(f"max_tokens {seed}")
    text = random.Random(f"text {seed}")
    jobs = [(at, row, "vip" if tenants.random() < VIP_SHARE else "chat-app", ASSISTANT_PROMPT)
            for at, row in trace]  # fmt: skip
    jobs += [(at, row, "batch", EXTRACTION_PROMPT) for at, row in bulk]
    items = []
    for at, row, tenant, system_prompt in jobs:
        max_tokens = limits.choice(MIXED_MAX_TOKENS) if mixed else FIXED_MAX_TOKENS
        system, user = prompt(text, row.context_tokens, system_prompt)
        worst = max(row.context_tokens, template_tokens(None) + 1) + (max_tokens or 0)
        kind = "long" if worst >= LONG_POOL_MIN_TOKENS else "short"
        items.append(chat(at, kind, tenant, system, [user], [], max_tokens,
                          {OUTPUT_TOKENS_HEADER: str(row.generated_tokens)}))  # fmt: skip
    items.sort(key=lambda item: item.at_s)
    return items


def build_trace(seed: int, duration_s: float, rate: float) -> list[WorkItem]:
    return build(seed, duration_s, rate, mixed=False)


def build_trace_mixed(seed: int, duration_s: float, rate: float) -> list[WorkItem]:
    return build(seed, duration_s, rate, mixed=True)
