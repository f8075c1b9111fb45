"""A seeded, mixed workload for the demo and the benchmarks, and the driver that runs it.

Three kinds of request, from three tenants:
  * short chats (tenants `chat-app` and `vip`) sharing one long system prompt — a few of them
    with a trailing space and a CRLF in it, the kind of difference that kills prefix-cache hits;
  * long documents (tenant `batch`) of several thousand tokens.
Arrivals are open-loop (Poisson at `rate` per second), so an overloaded target sees its queue
grow, as production traffic would make it. The driver streams every request and measures time
to first token at the client.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import orjson

SYSTEM_PROMPT = (
    "You are the support assistant of Example Corp. Answer in at most three sentences. "
    "Policies: be precise; cite the relevant article of the handbook; never invent facts; "
    "if unsure, say so and point to the help centre. "
) * 8  # ~400 tokens, shared by every short chat

TOPICS = ["billing", "refunds", "shipping", "passwords", "invoices", "accounts", "API keys",
          "rate limits", "exports", "webhooks", "SSO", "quotas"]


@dataclass(frozen=True, slots=True)
class WorkItem:
    at_s: float  # when to send, from the start
    kind: str  # "short" or "long"
    tenant: str
    body: dict[str, Any]
    # Sent as they are beside the tenant header: the benchmark's X-Sim-Output-Tokens, which
    # tells a simulated replica where the answer ends (kvgate.sim.options).
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Result:
    kind: str
    tenant: str
    status: int  # 0: no HTTP answer (connection dropped, timed out) or an error mid-stream
    ttft_s: float | None
    error_code: str | None
    e2e_s: float | None
    pool: str | None
    replica: str | None
    sent_s: float | None = None  # when it was sent, from the start of the run
    output_tokens: int | None = None  # the completion's tokens, from the stream's usage
    retry_after_s: float | None = None  # a refusal's Retry-After
    prompt_tokens: int | None = None  # the prompt's tokens, from the stream's usage


def build_workload(
    seed: int = 0,
    duration_s: float = 10.0,
    rate: float = 20.0,
    long_fraction: float = 0.08,
    variant_fraction: float = 0.25,
    model: str = "sim-model",
    long_words: tuple[int, int] = (3500, 5000),
) -> list[WorkItem]:
    """`long_words`: a long document's length in words, at least and at most."""
    rng = random.Random(seed)
    items: list[WorkItem] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return items
        if rng.random() < long_fraction:
            words = rng.randint(*long_words)
            document = " ".join(rng.choice(TOPICS) for _ in range(words))
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": "Summarise the document for an analyst."},
                    {"role": "user", "content": document},
                ],
                "max_tokens": 512,
            }
            items.append(WorkItem(t, "long", "batch", body))
            continue
        system = SYSTEM_PROMPT
        if rng.random() < variant_fraction:
            # The same prompt, byte-different in the ways clients really differ: a timestamp
            # in the first line, CRLF line endings, trailing spaces.
            stamp = f"Now: 2026-11-29T{rng.randint(0, 23):02}:{rng.randint(0, 59):02}Z\r\n"
            system = stamp + system + " " * rng.randint(1, 3)
        question = f"Question {len(items)} about {rng.choice(TOPICS)}: how does it work for me?"
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": rng.choice([128, 192, 256]),
        }
        tenant = "vip" if rng.random() < 0.2 else "chat-app"
        items.append(WorkItem(t, "short", tenant, body))


async def run_workload(
    base_url: str,
    items: list[WorkItem],
    *,
    tenant_header: str | None = "X-Tenant-Id",
    targets: dict[str, list[str]] | None = None,
    timeout_s: float = 120.0,
    first_token_timeout_s: float | None = None,
) -> list[Result]:
    """Send every item at its time, streaming, and return one result per item, in order.

    `targets` maps a kind ("short", "long") to base URLs to round-robin over instead of one
    gateway: the baseline without kvgate, or several gateways sharing the load. A request not
    finished `timeout_s` after it was sent, or without its first token (or an answer that is
    not a stream) `first_token_timeout_s` after, is cancelled and counts as `TimeoutError`."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    turns: Counter[str] = Counter()

    def url_for(item: WorkItem) -> str:
        if not targets:
            return base_url
        urls = targets[item.kind]
        turns[item.kind] += 1
        return urls[(turns[item.kind] - 1) % len(urls)]

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic()

        async def one(item: WorkItem) -> Result:
            await asyncio.sleep(max(0.0, item.at_s - (time.monotonic() - start)))
            body = {**item.body, "stream": True, "stream_options": {"include_usage": True}}
            headers = {**item.headers, **({tenant_header: item.tenant} if tenant_header else {})}
            sent = time.monotonic()
            base = url_for(item)
            failed = partial(Result, item.kind, item.tenant, 0, None, sent_s=sent - start)
            waiting = asyncio.timeout(first_token_timeout_s)
            post = session.post(f"{base}/v1/chat/completions", data=orjson.dumps(body),
                                headers={**headers, "Content-Type": "application/json"})
            try:
                async with waiting, post as response:
                    pool = response.headers.get("X-Kvgate-Pool")
                    replica = response.headers.get("X-Kvgate-Replica") or base
                    if response.status != 200:
                        data = await response.json(content_type=None)
                        code = (data.get("error") or {}).get("code") if isinstance(data, dict) else None
                        return Result(item.kind, item.tenant, response.status, None, str(code),
                                      None, pool, replica, sent - start, None,
                                      _retry_after(response.headers.get("Retry-After")))
                    ttft = None
                    output_tokens = prompt_tokens = None
                    async for line in response.content:
                        if ttft is None and _has_text(line):
                            ttft = time.monotonic() - sent
                            waiting.reschedule(None)  # streaming: only timeout_s applies now
                        elif line.startswith(b'data: {"error"'):
                            return failed("stream_error", None, pool, replica)
                        elif b'"usage":{' in line and line.startswith(b"data: {"):
                            usage = orjson.loads(line[6:]).get("usage") or {}
                            output_tokens = usage.get("completion_tokens")
                            prompt_tokens = usage.get("prompt_tokens")
                    e2e = time.monotonic() - sent
                    return Result(item.kind, item.tenant, 200, ttft, None, e2e, pool, replica,
                                  sent - start, output_tokens, prompt_tokens=prompt_tokens)
            except (aiohttp.ClientError, TimeoutError) as exc:
                return failed(type(exc).__name__, None, None, None)

        return await asyncio.gather(*(one(item) for item in items))


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _has_text(line: bytes) -> bool:
    return line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line


@dataclass
class Summary:
    requests: int = 0
    completed: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    failed: int = 0
    ttft: dict[str, dict[str, float | None]] = field(default_factory=dict)
    e2e: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "completed": self.completed, "refused": self.refused,
                "failed": self.failed, "ttft_s": self.ttft, "e2e_s": self.e2e}


def summarize(results: list[Result]) -> Summary:
    summary = Summary(requests=len(results))
    refused: Counter[str] = Counter()
    for r in results:
        if r.status == 200:
            summary.completed += 1
        elif 400 <= r.status < 500:
            refused[f"{r.status} {r.error_code}"] += 1
        else:
            summary.failed += 1
    summary.refused = dict(refused)
    groups: dict[str, list[Result]] = {"short": [], "long": []}
    for r in results:
        groups[r.kind].append(r)
        groups.setdefault(f"tenant {r.tenant}", []).append(r)
    for kind, members in groups.items():
        ttfts = sorted(r.ttft_s for r in members if r.ttft_s is not None)
        summary.ttft[kind] = {"p50": percentile(ttfts, 0.50), "p99": percentile(ttfts, 0.99),
                              "n": len(ttfts)}
        e2es = sorted(r.e2e_s for r in members if r.e2e_s is not None)
        summary.e2e[kind] = {"p50": percentile(e2es, 0.50), "p99": percentile(e2es, 0.99),
                             "n": len(e2es)}
    return summary


def within_slo(result: Result, *, short_ttft_s: float, long_ttft_s: float) -> bool:
    """Completed, and its first token came within its kind's latency target."""
    if result.status != 200 or result.ttft_s is None:
        return False
    return result.ttft_s <= (long_ttft_s if result.kind == "long" else short_ttft_s)


def goodput(
    results: list[Result], duration_s: float, *, short_ttft_s: float, long_ttft_s: float
) -> float:
    """Requests per second of the workload's duration that completed within their latency
    target (the times all in one unit: wall seconds, or simulated ones)."""
    good = sum(within_slo(r, short_ttft_s=short_ttft_s, long_ttft_s=long_ttft_s) for r in results)
    return good / duration_s if duration_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    index = min(len(values) - 1, max(0, round(q * len(values) + 0.5) - 1))
    return values[index]
