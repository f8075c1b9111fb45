"""The benchmark's workloads: seeded, open-loop, in *simulated* seconds.

`mix` is the demo's (`kvgate.tools.workload.build_workload`): chats sharing a system prompt, some
with a timestamp and trailing spaces, and long documents. `trace` and `trace-mixed` replay a
production trace (`trace.py`). `realistic` is what a chat product sees, with three tenants:

  * `vip` (critical, a small share): single questions to a support assistant, max_tokens 1024;
  * `chat-app` (standard): multi-turn sessions whose every turn resends the whole history,
    max_tokens 1024–4096 (answers are a few hundred tokens: the fleet's output lengths are
    lognormal, see `fleet.py`); and now and then a long document to summarise, which goes to
    the long-context pool;
  * `batch` (sheddable): bursts of extraction jobs, a dozen at once.

`rag` is reuse of long shared content: RAG_DOCUMENTS documents of 1,000-2,000 tokens, each
asked about by many users in separate single-question chats under one system prompt (vip's
8% critical, the rest chat-app's). Every request's prompt is a document most of whose blocks
some replica already caches, which only the replicas' KV events show a router (the
fingerprint of the system prompt is the same for all of them); the replicas publish them.

Arrivals are Poisson (sessions and bursts start as Poisson processes; a session's next turn
follows after a think time, whatever happened to the previous one, so the workload is the
same for every contender). Sessions already start before time 0 (their earlier turns are
history, never sent), so requests arrive at the full rate from the first second. Every word of the generated text is one cl100k token, so the
prompt sizes below are close to what the replicas count.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.tools.workload import SYSTEM_PROMPT, WorkItem, build_workload

from . import trace
from .prompts import ASSISTANT_PROMPT, EXTRACTION_PROMPT, MODEL, RAG_PROMPT, chat, words

# Shares of the realistic workload's requests.
VIP_SHARE, DOCUMENT_SHARE, BATCH_SHARE = 0.08, 0.05, 0.20
CHAT_SHARE = 1.0 - VIP_SHARE - DOCUMENT_SHARE - BATCH_SHARE
TURNS = (1, 2, 3, 4)  # per session, uniformly: 2.5 on average
THINK_S = 6.0  # mean simulated seconds between a session's turns
BURST = (8, 16)  # jobs per batch burst, uniformly
BURST_SPREAD_S = 2.0  # a burst's jobs arrive within this many simulated seconds
DOCUMENT_TOKENS = (9000, 14000)  # long documents: prompt + max_tokens is above 8192
RAG_DOCUMENTS, RAG_DOCUMENT_TOKENS = 32, (1000, 2000)
# The trace's run settings (simulated seconds; wall seconds per simulated second).
TRACE_WARMUP_S, TRACE_DURATION_S, TRACE_TIME_SCALE = 12.0, 36.0, 0.25


@dataclass(frozen=True, slots=True)
class Workload:
    """A named workload: how to build it, and how its long requests are told apart."""

    name: str
    build: Callable[[int, float, float], list[WorkItem]]  # (seed, duration_s, rate) -> items
    # kvgate's long pool takes requests whose worst case (prompt + max_tokens) reaches this.
    long_pool_min_tokens: int
    # The fleet's output lengths for this workload (SimConfig.output_len_* keys).
    output_lengths: dict[str, Any]
    # Run settings (simulated seconds): arrivals not counted, then counted; and how fast the
    # replicas run (wall seconds per simulated second), slow enough for two cores to keep up
    # with the workload's request rate at 3x.
    warmup_s: float
    duration_s: float
    time_scale: float
    describe: str = ""
    repeats: int = 1  # runs of every cell unless --repeats says otherwise
    kv_events: bool = False  # the replicas publish vLLM's KV cache events


def build_mix(seed: int, duration_s: float, rate: float) -> list[WorkItem]:
    return build_workload(seed=seed, duration_s=duration_s, rate=rate, model=MODEL)


def build_realistic(seed: int, duration_s: float, rate: float) -> list[WorkItem]:
    """About `rate` requests per simulated second for `duration_s`, sorted by arrival."""
    rng = random.Random(seed)
    items: list[WorkItem] = []
    mean_turns = sum(TURNS) / len(TURNS)
    lead = THINK_S * max(TURNS) * 2  # sessions under way at time 0
    for start in _poisson(rng, rate * CHAT_SHARE / mean_turns, duration_s + lead):
        items.extend(_session(rng, start - lead, duration_s))
    for at in _poisson(rng, rate * VIP_SHARE, duration_s):
        question = f"Question about {words(rng, 3)}: {words(rng, rng.randint(20, 60))}?"
        items.append(chat(at, "short", "vip", SYSTEM_PROMPT, [question], [], 1024))
    for at in _poisson(rng, rate * DOCUMENT_SHARE, duration_s):
        document = words(rng, rng.randint(*DOCUMENT_TOKENS))
        items.append(chat(at, "long", "chat-app", "Summarise the document for an analyst.",
                          [document], [], rng.choice([1024, 2048])))  # fmt: skip
    mean_burst = sum(BURST) / 2
    for burst in _poisson(rng, rate * BATCH_SHARE / mean_burst, duration_s):
        for _ in range(rng.randint(*BURST)):
            at = burst + rng.uniform(0, BURST_SPREAD_S)
            if at < duration_s:
                text = words(rng, rng.randint(300, 600))
                items.append(chat(at, "short", "batch", EXTRACTION_PROMPT, [text], [],
                                  rng.choice([1024, 2048])))  # fmt: skip
    items.sort(key=lambda item: item.at_s)
    return items


def build_rag(seed: int, duration_s: float, rate: float) -> list[WorkItem]:
    """About `rate` questions per simulated second for `duration_s`, each about one of the
    shared documents (the same documents for every seed), sorted by arrival."""
    corpus = random.Random(7_919)
    documents = [words(corpus, corpus.randint(*RAG_DOCUMENT_TOKENS)) for _ in range(RAG_DOCUMENTS)]
    rng = random.Random(seed)
    items: list[WorkItem] = []
    for at in _poisson(rng, rate, duration_s):
        n = rng.randrange(RAG_DOCUMENTS)
        question = f"Document {n}:\n{documents[n]}\n\nWhat does it say of {words(rng, 2)}?"
        tenant = "vip" if rng.random() < VIP_SHARE else "chat-app"
        items.append(chat(at, "short", tenant, RAG_PROMPT, [question], [], 1024))
    return items


def _session(rng: random.Random, start: float, duration_s: float) -> list[WorkItem]:
    """One user's conversation: each turn resends the system prompt and every earlier turn."""
    questions: list[str] = []
    answers: list[str] = []
    turns: list[WorkItem] = []
    at = start
    for _ in range(rng.choice(TURNS)):
        if at >= duration_s:
            break
        questions.append(f"{words(rng, rng.randint(15, 80))}?")
        max_tokens = rng.choice([1024, 2048, 4096])
        if at >= 0:  # earlier turns happened before the run: history only
            turns.append(chat(at, "short", "chat-app", ASSISTANT_PROMPT, questions, answers,
                              max_tokens))  # fmt: skip
        # What the assistant said, as the client will resend it: a few hundred tokens.
        answers.append(words(rng, min(600, int(rng.lognormvariate(5.6, 0.5)))))
        at += rng.expovariate(1 / THINK_S)
    return turns


def _poisson(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    times: list[float] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return times
        times.append(t)
    return times


WORKLOADS: dict[str, Workload] = {
    # The demo's: answers use 60–100% of max_tokens, near the worst case. Many small chats
    # (the fleet serves ~25 a second), so a slower clock; their answers end within seconds.
    "mix": Workload("mix", build_mix, 3072,
                    {"output_len_dist": "uniform", "output_len_min_fraction": 0.6},
                    warmup_s=8.0, duration_s=20.0, time_scale=0.5),
    # max_tokens 1024–4096 and answers of a few hundred tokens: a median of 10% of max_tokens,
    # 99% under a third of it (at ~30 tokens/s, a 4096-token answer would outlast a run).
    "realistic": Workload("realistic", build_realistic, 8192,
                          {"output_len_dist": "lognormal", "output_len_median_fraction": 0.1,
                           "output_len_sigma": 0.5},
                          warmup_s=12.0, duration_s=36.0, time_scale=0.25,
                          describe="multi-turn chats (chat-app, standard), single questions "
                                   "(vip, critical), long documents, bursts of extraction jobs "
                                   "(batch, sheddable); max_tokens 1,024-4,096, answers a "
                                   "lognormal 10% of it"),
    # Shared documents: prompts of 1,000-2,000 tokens that the replicas cache, answers a
    # lognormal 15% of max_tokens 1,024 (about 150 tokens).
    "rag": Workload("rag", build_rag, 8192,
                    {"output_len_dist": "lognormal", "output_len_median_fraction": 0.15,
                     "output_len_sigma": 0.5},
                    warmup_s=12.0, duration_s=36.0, time_scale=0.25, repeats=3, kv_events=True,
                    describe=f"{RAG_DOCUMENTS} shared documents of 1,000-2,000 tokens, each "
                             "asked about by many users under one system prompt (8% vip, "
                             "critical; the rest chat-app); max_tokens 1,024, answers a "
                             "lognormal 15% of it; the replicas publish KV cache events"),
    # A production trace: its answer lengths ride on each request (no output_len_* needed).
    **{name: Workload(name, build, trace.LONG_POOL_MIN_TOKENS, {},
                      warmup_s=TRACE_WARMUP_S, duration_s=TRACE_DURATION_S,
                      time_scale=TRACE_TIME_SCALE, repeats=3,
                      describe=f"Azure's LLM conversation trace (2023), 2,000 rows, time-"
                               f"compressed; {trace.VIP_SHARE:.0%} of its requests vip (critical), the "
                               f"rest chat-app (standard); {trace.BULK_SHARE:.0%} of all requests "
                               f"batch (sheddable) bursts of trace rows; answers end at the "
                               f"trace's GeneratedTokens; max_tokens {limits}")
       for name, build, limits in (
           ("trace", trace.build_trace, "1,024 on every request"),
           ("trace-mixed", trace.build_trace_mixed, "a seeded third each of none, 2,048 and 4,096"))},
}  # fmt: skip
