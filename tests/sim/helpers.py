"""Small helpers shared by the simulator's tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

EVENTUALLY_S = 5.0


async def eventually(predicate: Callable[[], bool]) -> None:
    """Wait until `predicate()` holds (state another task changes), failing after 5 s."""
    async with asyncio.timeout(EVENTUALLY_S):
        # Polling on purpose: the state lives in the replica, which offers no event for it.
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)

# A replica that answers in milliseconds: small pool, fast simulated GPU.
FAST = {"time_scale": 0.001, "num_gpu_blocks": 256, "max_model_len": 1024}
