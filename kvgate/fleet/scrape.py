"""Reading a replica's vLLM figures: its /metrics scraped and parsed into a `Scrape`, and the
`DecodeClock` that turns vLLM's generation-token counter into each sequence's output so far.

/metrics is read by discovery (`kvgate.fleet.discovery`) and once more when the last of this
instance's requests on a replica ends, or before an answer that ended unseen (its client
left, kvgate stopped waiting, or its body went past kvgate behind Envoy) is charged
(`metrics_read_after`): within the discovery timeout, after the answer's fate is sealed.
Those reads are spaced READ_GAP_S apart per replica: whatever ends meanwhile shares the next,
so a replica's /metrics is read at most a few times a second whatever the request rate. A
slow or failing read leaves the figures to age.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from kvgate.fleet.replicas import Replica

log = logging.getLogger(__name__)

# Current name first; older vLLM versions use the second.
_ALIASES = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:gpu_prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:gpu_prefix_cache_hits": "prefix_hits",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:admission_rejections": "admission_rejections",  # vLLM 0.33+, summed over reasons
}


@dataclass(slots=True)
class Scrape:
    """One reading of a replica's vLLM metrics (sums over data-parallel engines; its blocks
    the server's total)."""

    at: float
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    generation_tokens: float | None = None
    admission_rejections: float | None = None  # requests its queue limits refused (503)
    # when its engine's counters began (their `_created`, the latest over its engines): a
    # new value is a restarted engine, whatever its other figures say
    started_at: float | None = None
    # its data-parallel engines (the `engine` label: their ranks), where the series say
    engines: tuple[int, ...] = ()


class DecodeClock:
    """Output tokens one sequence on a replica has produced since kvgate began watching it:
    vLLM's generation-token counter divided among its running sequences, summed over
    successive scrapes of /metrics, extrapolated between them. A non-streamed request, whose
    tokens kvgate does not see until the answer, has produced what the clock advanced since it
    reached the replica (within its max_tokens): the replica's own count over this request's
    life, which follows its load and its pace as they change, where a pace taken from earlier
    requests would not. With one sequence running it is that sequence's exact count."""

    def __init__(self) -> None:
        self.tokens = 0.0  # at the last scrape
        self.rate: float | None = None  # per sequence, tokens/s, from the last two scrapes
        self._at: float | None = None
        self._generated: float | None = None
        self._idle = False  # the last scrape saw no sequence running
        self._high = 0.0  # the highest reading `now` gave: a clock never runs back

    def observe(self, scrape: Scrape) -> None:
        """Take in a scrape; one older than the last taken (a slower read of the same
        replica) is left out."""
        generated, running = scrape.generation_tokens, scrape.running
        if generated is None or (self._at is not None and scrape.at <= self._at):
            return
        if self._at is not None and self._generated is not None:
            step = generated - self._generated
            if step >= 0:  # less: the replica restarted
                per_sequence = step / max(1.0, running or 0.0)
                self.rate = per_sequence / (scrape.at - self._at)
                self.tokens += per_sequence
        self._at, self._generated, self._idle = scrape.at, generated, running == 0

    def reading(self, at: float | None = None) -> float | None:
        """The clock at `at` (default: now), extrapolated from the last scrape at the last
        rate while the last scrape saw a sequence running (none running: it holds still);
        None until two scrapes have been seen. Read at a scrape, it is that scrape's count."""
        if self.rate is None or self._at is None:
            return None
        at = time.monotonic() if at is None else at
        if self._idle:
            return self.tokens
        return self.tokens + self.rate * max(0.0, at - self._at)

    def now(self, at: float | None = None) -> float | None:
        """`reading`, but never less than a reading given before: extrapolating at the last
        rate can run ahead of what the next scrape integrates (the rate fell, the replica
        restarted), and then the clock holds still until the integral catches up rather than
        running back (what a request has written never shrinks)."""
        reading = self.reading(at)
        if reading is None:
            return None
        self._high = max(self._high, reading)
        return self._high


_INFO = "vllm:cache_config_info"
# when the engine's generation counter began: its start (`Scrape.started_at`)
_STARTED = "vllm:generation_tokens_created"
_READ = frozenset(_ALIASES) | {_INFO, _STARTED}


def read_lines(text: str) -> str:
    """The lines of the families kvgate reads (a counter's may carry `_total`), comments
    included: prometheus_client's parser costs some 13 µs a line, and vLLM's histograms, which
    kvgate does not read, are most of its exposition. A family kvgate does not read cannot
    make the scrape unreadable either."""
    kept = []
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("#"):
            parts = stripped.split(None, 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue
            name = parts[2]
        else:
            name = stripped.partition("{")[0].partition(" ")[0]
        if name.removesuffix("_total") in _READ:
            kept.append(stripped)
    kept.append("")
    return "\n".join(kept)


def parse_vllm_metrics(text: str, at: float) -> Scrape:
    scrape = Scrape(at=at)
    sums: dict[str, float] = {}
    usage: list[float] = []
    blocks = 0
    block_size = None
    engines: set[int] = set()
    for family in text_string_to_metric_families(read_lines(text)):
        if family.name == _INFO:
            # one series per data-parallel engine, each with the server's cache config: its
            # num_gpu_blocks is already the sum over the engines (vLLM adds each engine's
            # blocks up at start-up), so a replica's capacity is that, not a sum of sums
            for sample in family.samples:
                n = sample.labels.get("num_gpu_blocks", "None")
                if n.isdigit():
                    blocks = max(blocks, int(n))
                size = sample.labels.get("block_size", "")
                if size.isdigit():
                    block_size = int(size)
            continue
        if family.name == _STARTED:  # the text format's own family for `_created`
            scrape.started_at = max((sample.value for sample in family.samples), default=None)
            continue
        kind = _ALIASES.get(family.name)
        if kind is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            engine = sample.labels.get("engine", "")
            if engine.isdigit():
                engines.add(int(engine))
            if kind == "kv_usage":
                usage.append(sample.value)
            else:
                sums[kind] = sums.get(kind, 0.0) + sample.value
    scrape.num_gpu_blocks = blocks or None
    scrape.block_size = block_size
    scrape.engines = tuple(sorted(engines))
    scrape.kv_usage = sum(usage) / len(usage) if usage else None
    for kind, value in sums.items():
        setattr(scrape, kind, value)
    return scrape


@dataclass(frozen=True, slots=True)
class MetricsRead:
    """One read of a replica's /metrics, under way or due: when it is sent, and its task."""

    sent_at: float
    task: asyncio.Task[bool]


# The least time between two reads of a replica's /metrics on demand (not discovery's): a
# charge waits at most this long for figures that cover its request's end, and a replica
# answering a thousand requests a second is read four times a second, not a thousand.
READ_GAP_S = 0.25


async def read_metrics(session: aiohttp.ClientSession, replica: Replica, timeout_s: float) -> bool:
    """Read the replica's /metrics into its scrape and its decode clock; False when it could
    not be read (then its figures age, and turn unknown once stale)."""
    try:
        async with session.get(
            f"{replica.url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return False
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:  # RuntimeError: closed
        log.debug("replica %s: /metrics not read: %s", replica.id, exc or type(exc).__name__)
        return False
    try:
        scrape = await asyncio.to_thread(parse_vllm_metrics, text, time.monotonic())
    except ValueError as exc:
        log.warning("replica %s: unreadable /metrics: %s", replica.id, exc)
        return False
    if replica.scrape is None or scrape.at > replica.scrape.at:  # reads may overlap
        replica.scrape = scrape
    replica.decode_clock.observe(scrape)
    return True


async def _read_later(
    session: aiohttp.ClientSession, replica: Replica, delay_s: float, timeout_s: float
) -> bool:
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    return await read_metrics(session, replica, timeout_s)


def metrics_read_after(
    session: aiohttp.ClientSession, replica: Replica, moment: float, timeout_s: float
) -> asyncio.Task[bool]:
    """A read of the replica's /metrics sent after `moment` (say, when a request ended there):
    the one under way or due since then, or a new one, sent now or READ_GAP_S after the one
    before, so that requests that end together share it. Await it (shielded: others share
    it) for figures that cover what happened until `moment`; it is False when /metrics could
    not be read."""
    pending = replica.reading
    if pending is not None and pending.sent_at >= moment:
        return pending.task
    now = time.monotonic()
    due = now if pending is None else max(now, pending.sent_at + READ_GAP_S)
    task = asyncio.ensure_future(_read_later(session, replica, due - now, timeout_s))
    replica.reading = MetricsRead(due, task)
    return task
