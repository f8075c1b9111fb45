"""Simulated vLLM replicas on real sockets.

    async def test_something(sim_factory):
        replica = await sim_factory(num_gpu_blocks=256, max_model_len=1024, time_scale=0.01)
        ...  # replica.url, replica.engine, replica.faults

`sim_factory(**overrides)` takes any `SimConfig` field (`faults` may be a `Faults` or a
mapping), starts a replica on a free port and stops every replica it started at teardown.
Defaults are `SimConfig`'s own (time_scale=1.0: pass a small time_scale for fast tests).
The tiktoken tokenizer is loaded once per session and shared.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import pytest

from kvgate.request.tokenizers import TiktokenTokenizer, load_tiktoken
from kvgate.sim.config import SimConfig
from kvgate.sim.faults import Faults
from kvgate.sim.server import SimReplica

SimFactory = Callable[..., Awaitable[SimReplica]]


@pytest.fixture(scope="session")
def sim_tokenizer() -> TiktokenTokenizer:
    return load_tiktoken()


@pytest.fixture
async def sim_factory(sim_tokenizer: TiktokenTokenizer) -> AsyncIterator[SimFactory]:
    replicas: list[SimReplica] = []

    async def factory(**overrides: Any) -> SimReplica:
        faults = overrides.get("faults")
        if isinstance(faults, Mapping):
            overrides["faults"] = Faults.from_mapping(faults)
        replica = SimReplica(SimConfig(**overrides), tokenizer=sim_tokenizer)
        await replica.start()
        replicas.append(replica)
        return replica

    yield factory
    for replica in replicas:
        await replica.stop()
