"""The replica registry: what kvgate knows about each vLLM replica, and which replicas there
are (listed in the config, or found by DNS or from an InferencePool), kept in place across
reloads and rounds.

Discovery (`kvgate.fleet.discovery`) keeps each replica's health, models and scraped figures
(`kvgate.fleet.scrape`) fresh; the request path records what its requests write there.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any

from yarl import URL

from kvgate.config import ReplicaConfig, secret
from kvgate.fleet.scrape import DecodeClock, MetricsRead, Scrape
from kvgate.tools.capacity import DEFAULT_BLOCK_SIZE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Writing:
    """One in-flight request on a replica, as the written view counts it: `progress()` tokens
    written so far (prompt + output), of which the blocks keyed `shared` (its leading full
    blocks, as `kvgate.admission.demand.Demand.shared_keys` names them) are stored once by
    vLLM's prefix cache however many requests use them."""

    progress: Callable[[], int]
    shared: Sequence[Hashable] = ()


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
    failed_checks: int = 0  # discovery's checks failed in a row
    answered_at: float = -1e18  # when it last answered one of our requests (monotonic)
    # request key -> what it has written so far, for this instance's in-flight requests here
    inflight: dict[str, Writing] = field(default_factory=dict)
    decode_clock: DecodeClock = field(default_factory=DecodeClock)
    # a read of /metrics under way for requests that need figures from after they ended
    reading: MetricsRead | None = None
    drain_requested: bool = False  # by POST /admin/replicas/{id}/drain (undone by .../undrain)
    vanished: bool = False  # its source no longer gives it: drained, then forgotten

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
    def address(self) -> str:
        """Where it listens, as `host:port` (`[v6]:port`): how Envoy and the Gateway API's
        endpoint picker protocol name an endpoint."""
        url = URL(self.config.url)
        host = f"[{url.host}]" if url.host and ":" in url.host else url.host
        return f"{host}:{url.port}"

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
        """Blocks this instance's in-flight requests hold here: each its own, and the shared
        blocks it has written once, however many requests use them."""
        size = self.kv_block_size
        total = 0
        shared: set[Hashable] = set()
        for writing in self.inflight.values():
            tokens = writing.progress()
            written = min(len(writing.shared), tokens // size)
            total += math.ceil(tokens / size) - written
            shared.update(writing.shared[:written])
        return total + len(shared)


class Registry:
    """All replicas by id, with the pool each belongs to: those the config lists and those
    a pool's source finds (its DNS name, its InferencePool). Reconfigured in place on reload
    and on every round, so that in-flight requests and their replica objects stay valid; a
    replica that leaves (a reload dropped it, its address stopped resolving, its pod is no
    longer ready) while requests still run there stays, draining, until they finish."""

    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}
        self._listed: dict[str, list[ReplicaConfig]] = {}
        self._found: dict[str, list[ReplicaConfig]] = {}

    def sync(
        self, pools: Mapping[str, Iterable[ReplicaConfig]], found: Collection[str] = ()
    ) -> None:
        """The config's replicas, per pool, and which pools find more (by DNS, or from an
        InferencePool) (a reload): a pool that lost its source loses the replicas found
        through it."""
        self._listed = {pool: list(configs) for pool, configs in pools.items()}
        self._found = {pool: had for pool, had in self._found.items() if pool in found}
        self._rebuild()

    def found(self, pool: str, configs: Iterable[ReplicaConfig]) -> None:
        """The replicas a pool's source (its DNS name, its InferencePool) gives now."""
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

    def outside(self, subset: frozenset[str] | None) -> frozenset[str]:
        """The replicas not in `subset` (addresses host:port): none where it is None."""
        if subset is None:
            return frozenset()
        return frozenset(r.id for r in self._replicas.values() if r.address not in subset)

    def serves(self, model: str) -> bool:
        """Some replica serves `model`, as its /v1/models says."""
        return any(r.serves(model) for r in self._replicas.values())

    def in_pool(self, pool: str) -> list[Replica]:
        return [r for r in self._replicas.values() if r.pool == pool]

    def model_list(self) -> dict[str, Any]:
        """/v1/models: the union of what healthy replicas serve, whichever data plane asks."""
        data = [
            {"id": name, "object": "model", "owned_by": "kvgate", "max_model_len": length}
            for name, length in sorted(self.models().items())
        ]
        return {"object": "list", "data": data}

    def readiness(self, wanted: Iterable[str]) -> dict[str, Any]:
        """Whether the gateway can serve: every model in `wanted` (the configured ones; none:
        any model) has a healthy replica. /ready's body, and the picker's gRPC readiness."""
        served = self.models()
        wanted = list(wanted)
        missing = [m for m in wanted if m not in served]
        ok = not missing if wanted else bool(served)
        return {"ready": ok, "models": sorted(served), "missing": missing}

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


async def find(
    registry: Registry, reads: Mapping[str, Awaitable[list[ReplicaConfig]]],
    sources: Mapping[str, str],
) -> None:
    """One round of a source of found replicas (DNS, an InferencePool): every pool's read at
    once, each pool given what its read found; a read that fails keeps the pool's last
    answer (a blip must not empty a pool), and says why, naming its source."""
    answers = await asyncio.gather(*reads.values(), return_exceptions=True)
    for pool, answer in zip(reads, answers, strict=True):
        if isinstance(answer, BaseException):
            if isinstance(answer, asyncio.CancelledError):
                raise answer
            log.warning("pool %s: cannot read %s (keeping the last answer): %s",
                        pool, sources[pool], answer or type(answer).__name__)
            continue
        registry.found(pool, answer)
