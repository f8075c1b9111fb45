"""Waiting out an interval that a reload may change meanwhile.

A background loop that slept its whole interval as it stood when the sleep began would follow a
reload that shortened it only one old interval later: leases renewed every 10 s while a new
TTL of 3 s lets them expire, a discovery round 30 s away after the interval became 1 s.
`pause` reads the interval again at least every RECHECK_S.

The clock and the sleep are arguments so that a test can run a loop on time it moves itself
(tests/plugins/clock.py); kvgate passes none and runs on `time.monotonic` and `asyncio.sleep`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

RECHECK_S = 0.5

Sleep = Callable[[float], Awaitable[None]]


async def pause(
    interval_s: Callable[[], float],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Sleep = asyncio.sleep,
) -> None:
    """Wait until `interval_s()` seconds after the call, reading that interval again at least
    every RECHECK_S: a reload that shortens it ends the wait sooner, one that lengthens it
    prolongs the wait."""
    start = clock()
    while True:
        left = start + interval_s() - clock()
        if left <= 0:
            return
        await sleep(min(left, RECHECK_S))
