"""Finishing what a request started, whatever cancellation arrives.

aiohttp cancels a request's handler the moment its client hangs up — and many clients hang up
the moment they read `[DONE]`, exactly while kvgate gives back what the request held. A plain
`asyncio.shield(store.release(...))` protects that one call but not the coroutine around it:
the cancellation surfaces at the shielded `await`, and every release after it in the same
function (the shared prefix after the ledger lease, say) never runs. That leaked a prefix lease
per distinct system prompt until replicas refused work while idle (issue 8).

Two helpers, used for every hold kvgate takes and gives back:

- `finish(release)` runs `release` to its end as one unit, through any number of further
  cancellations, and only then lets the cancellation go on;
- `acquire(step, undo)` runs an acquiring step to its end; if the caller was cancelled
  meanwhile, what the step took is given back (with `finish`) before the cancellation goes on.

Both wait for the store rather than leaving work behind in the background: a store call is
bounded by its own timeout, and a request whose handler has returned holds nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


async def finish(release: Awaitable[T]) -> T:
    """Await `release` to completion even if the caller is cancelled (once or many times)
    meanwhile; then re-raise the first cancellation, or return the result."""
    task = asyncio.ensure_future(release)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            if not task.done():
                cancelled = cancelled or exc  # the caller was cancelled: keep waiting
                continue
            if cancelled is not None:
                raise cancelled from None
            raise
        except BaseException as exc:
            if cancelled is not None:
                # the caller only sees its cancellation: say what went wrong in the release
                log.error("a release failed after its request was cancelled", exc_info=exc)
                raise cancelled from None
            raise
        if cancelled is not None:
            raise cancelled
        return result


async def acquire(step: Awaitable[T], undo: Callable[[T], Awaitable[object]]) -> T:
    """Await an acquiring `step`; if the caller is cancelled before it ends, the step still
    completes and `undo(result)` gives back what it took, then the cancellation goes on.
    A step that fails took nothing and is not undone."""
    task = asyncio.ensure_future(step)
    try:
        return await finish(task)
    except asyncio.CancelledError:
        if task.done() and not task.cancelled() and task.exception() is None:
            await finish(undo(task.result()))
        raise
