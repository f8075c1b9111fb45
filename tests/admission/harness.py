"""What the admission tests share: a replica, a demand, a whole config around an admission
config, and a ledger with its admission stage on a memory store (`Harness`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvgate.admission.demand import Demand, ledger_key
from kvgate.admission.leases import LeaseKeeper
from kvgate.admission.stage import Admission
from kvgate.config import (
    AdmissionConfig,
    Config,
    PoolConfig,
    QueueConfig,
    ReplicaConfig,
    RoutingConfig,
    SessionsConfig,
)
from kvgate.errors import RateLimited
from kvgate.fleet.replicas import Replica
from kvgate.metrics import Metrics
from kvgate.state.base import StateStore
from kvgate.state.memory import MemoryStore
from tests.routing.fleets import in_order


def replica(name: str, blocks: int | None = 100, block_size: int = 16) -> Replica:
    config = ReplicaConfig(url=f"http://{name}:8000", name=name, num_gpu_blocks=blocks,
                           block_size=block_size)
    return Replica(config=config, pool="p", healthy=True, models=frozenset({"m"}))


def demand(tokens: int, tenant: str = "t", priority: str = "standard") -> Demand:
    return Demand("p", "m", tokens, tenant, priority)


def admit(harness: Any, demand: Demand, *replicas: Replica) -> Any:
    """Admit `demand` on the first of `replicas` (in this order) with room, under the
    harness's admission config."""
    return harness.admission.admit(demand, in_order(harness.admission, replicas), harness.config)


def whole(admission: AdmissionConfig | None = None) -> Config:
    """A whole config around `admission`, for the stages that read the config in force (its
    placeholder replica is not the tests': they pass their own; no session waits, so any
    wait budget is valid)."""
    return Config(
        pools={"p": PoolConfig(replicas=[ReplicaConfig(url="http://placeholder:8000")])},
        admission=admission or AdmissionConfig(),
        routing=RoutingConfig(sessions=SessionsConfig(affinity_wait_s=0)),
    )


class Harness:
    """Admission under `config` on a store (a memory one unless given); on `clock` where a
    test moves the queue's time itself."""

    def __init__(
        self, config: AdmissionConfig, store: StateStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store or MemoryStore()
        self.config = config
        current = whole(config)
        self.admission = Admission(
            self.store, Metrics(), lambda: current, LeaseKeeper(self.store, lambda: current),
            clock=clock,
        )

    async def held(self, r: Replica) -> int:
        return await self.store.held(ledger_key(r.id))


async def refused_behind_a_slow_pool(queue: QueueConfig) -> RateLimited:
    """A 50-block request behind 90 held of 100, in a pool whose requests hold a block 9 s
    (90 held free 10 blocks a second), under `queue`: the refusal it gets."""
    g = Harness(AdmissionConfig(target_utilization=1.0, queue=queue))
    r = replica("a", blocks=100)
    pool = g.admission.pool("p")
    for _ in range(4):
        pool.released(10, 9.0, time.monotonic())
    async with admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
        with pytest.raises(RateLimited) as refused:
            async with asyncio.timeout(queue.max_wait_s + 5), admit(
                g, Demand("p", "m", 16 * 50, "t", "standard"), r
            ):
                pass
    return refused.value
