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

Both start the step at once, in the caller's turn of the event loop (like Python 3.12's eager
tasks): a step that never suspends — every call to the in-memory store — completes there, with
no task, no shield and no extra loop round, and no cancellation can reach it. Only a step that
suspends gets a task of its own that carries it on (a task per store call is a measurable
share of the proxy's CPU). Unlike 3.12, that first stretch sees the caller as the current task, so a
step must not enter `asyncio.timeout()` before it first suspends (kvgate's store calls do not:
the Redis store's timeouts live in its pipeline's task).
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar, cast

T = TypeVar("T")
log = logging.getLogger(__name__)


async def finish(release: Awaitable[T]) -> T:
    """Await `release` to completion even if the caller is cancelled (once or many times)
    meanwhile; then re-raise the first cancellation, or return the result."""
    task, result = _start(release)
    if task is None:
        return cast(T, result)
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
    task, result = _start(step)
    if task is None:
        return cast(T, result)
    try:
        return await finish(task)
    except asyncio.CancelledError:
        if task.done() and not task.cancelled() and task.exception() is None:
            await finish(undo(task.result()))
        raise


def begin(step: Awaitable[T]) -> asyncio.Future[T]:
    """Start `step` now, eagerly, without waiting for it: a future of its outcome (already
    done when it never suspended). Await it later with `finish`."""
    try:
        task, result = _start(step)
    except Exception as exc:
        task = asyncio.get_running_loop().create_future()
        task.set_exception(exc)
        return task
    if task is None:
        task = asyncio.get_running_loop().create_future()
        task.set_result(cast(T, result))
    return task


async def together(*steps: Awaitable[Any] | None) -> list[Any]:
    """Await independent steps so that all start in this turn of the loop (a pipelining store
    then sends them in one round trip). Returns their results in order, an exception in the
    place of a step that raised one (never raised here), None for a step that is None. Use
    it inside `acquire` or `finish`, which carry it on whatever cancellation arrives."""
    results: list[Any] = []
    pending: list[tuple[int, asyncio.Future[Any]]] = []
    for step in steps:
        if step is None:
            results.append(None)
            continue
        try:
            task, value = _start(step)
        except Exception as exc:  # raised before suspending: that step's outcome
            results.append(exc)
            continue
        results.append(value)
        if task is not None:
            pending.append((len(results) - 1, task))
    if pending:
        ended = await asyncio.gather(*(task for _, task in pending), return_exceptions=True)
        for (i, _), value in zip(pending, ended, strict=True):
            results[i] = value
    return results


def _start(step: Awaitable[T]) -> tuple[asyncio.Future[T] | None, T | None]:
    """Run a coroutine up to its first suspension now. Returns (None, its result) when it
    finished there; otherwise (a task that carries it on, None). An exception it raises before
    suspending propagates as if it had been awaited."""
    if not asyncio.iscoroutine(step):
        return asyncio.ensure_future(step), None
    coro = cast(Coroutine[Any, Any, T], step)
    try:
        suspended_on = coro.send(None)
    except StopIteration as stop:
        return None, cast(T, stop.value)
    return asyncio.ensure_future(_carry_on(coro, suspended_on)), None


async def _carry_on(coro: Coroutine[Any, Any, T], suspended_on: Any) -> T:
    return await _resume(coro, suspended_on)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, T], suspended_on: Any) -> Generator[Any, Any, T]:
    """Hand what the coroutine waits on to the task running us, and what the task sends or
    throws back to the coroutine, until it returns."""
    while True:
        try:
            sent = yield suspended_on
        except BaseException as exc:  # thrown in by the task (a cancellation)
            try:
                suspended_on = coro.throw(exc)
            except StopIteration as stop:
                return cast(T, stop.value)
        else:
            try:
                suspended_on = coro.send(sent)
            except StopIteration as stop:
                return cast(T, stop.value)
