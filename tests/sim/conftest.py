"""Fixtures shared by the simulator's server tests: a fast replica and an HTTP session."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvgate.sim.server import SimReplica
from tests.plugins.sim import SimFactory
from tests.sim.helpers import FAST


@pytest.fixture
async def replica(sim_factory: SimFactory) -> SimReplica:
    return await sim_factory(**FAST)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
