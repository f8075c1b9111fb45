"""The replica registry: what kvgate knows about each vLLM replica, and the discovery loop
that keeps it fresh by scraping `/health`, `/v1/models` and `/metrics`.

Discovery runs in the background and never on a request's path: a slow or dead replica makes
its figures stale, never a request slow. Figures older than `stale_after_s` read as unknown;
a replica whose capacity is unknown (and not given in config) is not admitted to.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from kvgate.capacity import DEFAULT_BLOCK_SIZE
from kvgate.config import CurrentConfig, DiscoveryConfig, ReplicaConfig, secret
from kvgate.intervals import pause

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
    """One reading of a replica's vLLM metrics (sums over data-parallel engines)."""

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


@dataclass(frozen=True, slots=True)
class Writing:
    """One in-flight request on a replica, as the written view counts it: `progress()` tokens
    written so far (prompt + output), of which the first `prefix_tokens` are a prefix
    (`prefix_key`) that vLLM's cache stores once however many requests share it."""

    progress: Callable[[], int]
    prefix_key: str | None = None
    prefix_tokens: int = 0


class DecodeClock:
    """Output tokens one sequence on a replica has produced since kvgate began watching it:
    the integral of vLLM's generation-token rate per running sequence, from successive scrapes
    of /metrics, extrapolated between them. A non-streamed request, whose tokens kvgate does not
    see until the answer, has written what the clock advanced since it reached the replica
    (within its max_tokens): this follows the replica's load as it changes, where one rate
    taken when the request was sent would not."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.rate: float | None = None  # per sequence, tokens/s, from the last two scrapes
        self._at: float | None = None
        self._generated: float | None = None
        self._high = 0.0  # the highest reading given: a clock never runs back

    def observe(self, scrape: Scrape) -> None:
        generated, running = scrape.generation_tokens, scrape.running
        if generated is None:
            return
        if self._at is not None and self._generated is not None and scrape.at > self._at:
            step = generated - self._generated
            if step >= 0:  # less: the replica restarted
                elapsed = scrape.at - self._at
                self.rate = step / elapsed / max(1.0, running or 0.0)
                self.tokens += self.rate * elapsed
        self._at, self._generated = scrape.at, generated

    def now(self, at: float | None = None) -> float | None:
        """The clock's reading at `at` (default: now); None until two scrapes have been seen.

        Never less than a reading given before: extrapolating at the last rate can run ahead
        of what the next scrape integrates (the rate fell, the replica restarted), and then
        the clock holds still until the integral catches up rather than running back."""
        if self.rate is None or self._at is None:
            return None
        at = time.monotonic() if at is None else at
        self._high = max(self._high, self.tokens + self.rate * max(0.0, at - self._at))
        return self._high


def parse_vllm_metrics(text: str, at: float) -> Scrape:
    scrape = Scrape(at=at)
    sums: dict[str, float] = {}
    usage: list[float] = []
    blocks = 0
    block_size = None
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                n = sample.labels.get("num_gpu_blocks", "None")
                if n.isdigit():
                    blocks += int(n)
                size = sample.labels.get("block_size", "")
                if size.isdigit():
                    block_size = int(size)
            continue
        kind = _ALIASES.get(family.name)
        if kind is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if kind == "kv_usage":
                usage.append(sample.value)
            else:
                sums[kind] = sums.get(kind, 0.0) + sample.value
    scrape.num_gpu_blocks = blocks or None
    scrape.block_size = block_size
    scrape.kv_usage = sum(usage) / len(usage) if usage else None
    for kind, value in sums.items():
        setattr(scrape, kind, value)
    return scrape


@dataclass(slots=True)
class Replica:
    """A replica and what kvgate knows of it. Mutated only by discovery and the request path
    on the event loop thread."""

    config: ReplicaConfig
    pool: str
    healthy: bool = False
    models: frozenset[str] = frozenset()
    max_model_lens: dict[str, int] = field(default_factory=dict)
    scrape: Scrape | None = None
    last_seen: float = 0.0
    last_error: str | None = None
    # request key -> what it has written so far, for this instance's in-flight requests here
    inflight: dict[str, Writing] = field(default_factory=dict)
    # Output tokens per second of one sequence here, recently (None until a request ends).
    token_rate: float | None = None
    decode_clock: DecodeClock = field(default_factory=DecodeClock)
    drain_requested: bool = False  # by POST /admin/replicas/{id}/drain (undone by .../undrain)
    vanished: bool = False  # its DNS name no longer resolves to it: drained, then forgotten

    @property
    def draining(self) -> bool:
        return self.config.drain or self.drain_requested or self.vanished

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def api_key(self) -> str | None:
        return secret(self.config.api_key)

    def fresh_scrape(self, stale_after_s: float, now: float | None = None) -> Scrape | None:
        now = time.monotonic() if now is None else now
        if self.scrape is None or now - self.scrape.at > stale_after_s:
            return None
        return self.scrape

    @property
    def block_size(self) -> int | None:
        if self.config.block_size is not None:
            return self.config.block_size
        return self.scrape.block_size if self.scrape else None

    @property
    def kv_block_size(self) -> int:
        """The block size to count in: the replica's, or vLLM's default until it is known."""
        return self.block_size or DEFAULT_BLOCK_SIZE

    @property
    def num_gpu_blocks(self) -> int | None:
        if self.config.num_gpu_blocks is not None:
            return self.config.num_gpu_blocks
        return self.scrape.num_gpu_blocks if self.scrape else None

    def max_model_len(self, model: str) -> int | None:
        if self.config.max_model_len is not None:
            return self.config.max_model_len
        return self.max_model_lens.get(model)

    def serves(self, model: str) -> bool:
        return model in self.models

    def written_blocks(self) -> int:
        """Blocks this instance's in-flight requests hold here: each its own, and the full
        blocks of a shared prefix once, as vLLM's prefix cache stores them."""
        size = self.kv_block_size
        total = 0
        shared: dict[str, int] = {}
        for writing in self.inflight.values():
            tokens = writing.progress()
            prefix = min(writing.prefix_tokens, tokens) // size if writing.prefix_key else 0
            total += math.ceil(tokens / size) - prefix
            if prefix and writing.prefix_key is not None:
                shared[writing.prefix_key] = max(shared.get(writing.prefix_key, 0), prefix)
        return total + sum(shared.values())

    def observe_rate(self, tokens: int, seconds: float) -> None:
        """Fold in one sequence that produced `tokens` in `seconds` (a moving average, so the
        rate follows the replica's load)."""
        if tokens < 2 or seconds <= 0:
            return
        rate = tokens / seconds
        self.token_rate = rate if self.token_rate is None else 0.8 * self.token_rate + 0.2 * rate


class Registry:
    """All replicas by id, with the pool each belongs to: those the config lists and those
    found by resolving a pool's DNS name. Reconfigured in place on reload and on every DNS
    round, so that in-flight requests and their replica objects stay valid; a replica that
    leaves (a reload dropped it, its address stopped resolving) while requests still run there
    stays, draining, until they finish."""

    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}
        self._listed: dict[str, list[ReplicaConfig]] = {}
        self._found: dict[str, list[ReplicaConfig]] = {}

    def sync(
        self, pools: Mapping[str, Iterable[ReplicaConfig]], dns: Collection[str] = ()
    ) -> None:
        """The config's replicas, per pool, and which pools are found by DNS (a reload): a
        pool that lost its DNS name loses the replicas found through it."""
        self._listed = {pool: list(configs) for pool, configs in pools.items()}
        self._found = {pool: found for pool, found in self._found.items() if pool in dns}
        self._rebuild()

    def found(self, pool: str, configs: Iterable[ReplicaConfig]) -> None:
        """The replicas a pool's DNS name resolves to now."""
        self._found[pool] = list(configs)
        self._rebuild()

    def prune(self) -> None:
        """Forget replicas that left once their last request has finished."""
        self._rebuild()

    def _rebuild(self) -> None:
        wanted: dict[str, Replica] = {}
        listed_ids = {c.id for listed in self._listed.values() for c in listed}
        for pool, listed in self._listed.items():
            found = [c for c in self._found.get(pool, []) if c.id not in listed_ids]
            for config in [*listed, *found]:  # a listed replica's settings win over DNS
                current = self._replicas.get(config.id)
                if current is not None and current.url == config.url:
                    current.config, current.pool, current.vanished = config, pool, False
                    wanted[config.id] = current
                elif config.id not in wanted:
                    wanted[config.id] = Replica(config=config, pool=pool)
        for replica_id, replica in self._replicas.items():
            if replica_id not in wanted and replica.inflight:
                if not replica.vanished:
                    log.warning("replica %s left with requests in flight: draining", replica_id)
                replica.vanished = True
                wanted[replica_id] = replica
        self._replicas = wanted

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def in_pool(self, pool: str) -> list[Replica]:
        return [r for r in self._replicas.values() if r.pool == pool]

    def models(self) -> dict[str, int | None]:
        """Every model a healthy replica serves, with the smallest max_model_len reported."""
        out: dict[str, int | None] = {}
        for replica in self._replicas.values():
            if not replica.healthy:
                continue
            for model in replica.models:
                length = replica.max_model_len(model)
                known = out.get(model)
                out[model] = length if known is None else min(known, length or known)
        return out


async def discover(
    session: aiohttp.ClientSession, replica: Replica, config: DiscoveryConfig
) -> None:
    """Refresh one replica; on any failure mark it unhealthy and keep its last figures."""
    headers = {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    try:
        async with session.get(f"{replica.url}/health", timeout=timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"/health answered {resp.status}")
        async with session.get(f"{replica.url}/v1/models", headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"/v1/models answered {resp.status}")
            listing = orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
        if replica.healthy:
            log.warning("replica %s is unhealthy: %s", replica.id, exc or type(exc).__name__)
        replica.healthy = False
        replica.last_error = str(exc) or type(exc).__name__
        return
    # A slow or failing /metrics leaves the figures stale (then unknown), never the replica
    # out of rotation: routing and admission fall back to the ledger alone.
    metrics = ""
    try:
        async with session.get(f"{replica.url}/metrics", timeout=timeout) as resp:
            metrics = await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.debug("replica %s: /metrics not read: %s", replica.id, exc or type(exc).__name__)
    now = time.monotonic()
    models = {}
    for entry in listing.get("data", []) if isinstance(listing, dict) else []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            length = entry.get("max_model_len")
            models[entry["id"]] = length if isinstance(length, int) else None
    replica.models = frozenset(models)
    replica.max_model_lens = {m: n for m, n in models.items() if n is not None}
    if metrics:
        try:
            replica.scrape = await asyncio.to_thread(parse_vllm_metrics, metrics, now)
            replica.decode_clock.observe(replica.scrape)
        except ValueError as exc:
            log.warning("replica %s: unreadable /metrics: %s", replica.id, exc)
    if not replica.healthy:
        log.info("replica %s is healthy", replica.id)
    replica.healthy = True
    replica.last_seen = now
    replica.last_error = None


async def discovery_loop(
    session: Callable[[], aiohttp.ClientSession | None],
    registry: Registry,
    current: CurrentConfig,
    after_round: Callable[[], None] = lambda: None,
) -> None:
    """Scrape every replica each `discovery.interval_s` of the config in force, all at once,
    until cancelled; `after_round` runs after each round (new figures may let queued requests
    in)."""
    while True:
        settings, client = current().discovery, session()
        registry.prune()
        if client is not None:
            await asyncio.gather(*(discover(client, r, settings) for r in registry))
        after_round()
        await pause(lambda: current().discovery.interval_s)
