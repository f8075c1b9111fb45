"""An idle timeout that costs nothing per chunk: for relaying a stream.

`asyncio.timeout()` moved along with every chunk costs a timer cancelled and another scheduled
at every read and every write of a stream. Here a chunk only notes the time (`touch`);
one timer checks at each possible expiry whether anything moved since, and re-arms for the
next one if so: at most one timer per idle period, whatever the chunk rate.

    async with IdleTimeout(idle_s, deadline) as idle:
        while chunk := await read():
            idle.touch()
            ...

raises TimeoutError out of the block once `idle_s` passes with no `touch`, or at `deadline`
(loop time), whichever is first — as `asyncio.timeout()` would, by cancelling the task and
turning that one cancellation into TimeoutError; a cancellation from elsewhere stays one.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Literal

# uvloop's timers fire on whole milliseconds, possibly a little before the time asked for: an
# expiry this close counts as reached (otherwise the check re-arms itself at once, again and
# again, until the clock ticks over).
RESOLUTION_S = 0.001


class IdleTimeout:
    def __init__(self, idle_s: float, deadline: float) -> None:
        self.idle_s = idle_s
        self.deadline = deadline  # the event loop's clock
        self.expired = False
        self.reason: Literal["idle", "deadline"] | None = None  # why it expired
        self.checks = 0  # how often its timer fired: once per idle period, not per chunk
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    def touch(self) -> None:
        """Something moved: the idle period starts again from now."""
        self._last = self._loop.time()

    def _expiry(self) -> float:
        return min(self._last + self.idle_s, self.deadline)

    def _check(self) -> None:
        self.checks += 1
        expiry = self._expiry()
        if self._loop.time() < expiry - RESOLUTION_S:  # something moved: wait for the next
            self._handle = self._loop.call_at(expiry, self._check)
            return
        self._handle = None
        self.expired = True
        self.reason = "deadline" if self.deadline <= self._last + self.idle_s else "idle"
        assert self._task is not None
        self._task.cancel()

    async def __aenter__(self) -> IdleTimeout:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("IdleTimeout must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._last = self._loop.time()
        self._handle = self._loop.call_at(self._expiry(), self._check)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if not self.expired or self._task is None:
            return
        # our cancellation, if it is the only one pending, becomes TimeoutError
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc
