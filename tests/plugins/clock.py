"""Time that a test moves: a manual clock for what takes one, and `StoreTime` for the contract
suite, whose stores do not share a clock.

    clock = ManualClock()
    store = MemoryStore(clock=clock)
    clock.advance(10)          # the lease taken with ttl_s=10 has expired, with no sleep

    await store_time.advance(0.2)   # in tests/state/test_contract.py, on either store

    time = VirtualTime()
    app = build_app(config, MemoryStore(clock=time), clock=time, sleep=time.sleep)
    await time.elapse(2.5)     # the lease keeper runs every round due in those 2.5 s
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Protocol

# Loop turns given to the tasks woken at one instant: enough for a task to resume and run to
# its next sleep when what it awaits meanwhile is already done (a MemoryStore's calls are).
_TURNS = 20


class ManualClock:
    """A monotonic clock (`time.monotonic`'s signature) that moves only when told."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class StoreTime(Protocol):
    """Lets `seconds` pass for the store under test; afterwards at least that much time has
    passed by the store's clock."""

    async def advance(self, seconds: float) -> None: ...


class ManualStoreTime:
    """For a store on a ManualClock: time moves at once."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock

    async def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)


class RealStoreTime:
    """For a store that keeps its own clock (Redis): the test waits it out."""

    async def advance(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class VirtualTime(ManualClock):
    """A clock with a `sleep` on it that only `elapse` ends, for loops (the lease keeper's) run
    without waiting out real time.

    `elapse(seconds)` moves the time to each sleeper's wake-up in turn and lets the woken tasks
    run to their next sleep before moving on, so a loop runs every round due in that span, each
    at its own instant.
    """

    def __init__(self, start: float = 1_000.0) -> None:
        super().__init__(start)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def sleep(self, seconds: float) -> None:
        woken = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + max(seconds, 0.0), next(self._order), woken))
        await woken

    async def elapse(self, seconds: float) -> None:
        end = self.now + seconds
        while self._sleepers and self._sleepers[0][0] <= end:
            at, _, woken = heapq.heappop(self._sleepers)
            self.now = max(self.now, at)
            if not woken.done():
                woken.set_result(None)
            for _ in range(_TURNS):
                await asyncio.sleep(0)
        self.now = end
