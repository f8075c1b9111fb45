"""Waiting for state that another task changes: one poll loop for the whole suite.

    await eventually(lambda: replica.engine.running, what="a request running")
    await eventually(lambda: store_holds(0), timeout_s=10)   # an async predicate works too

A hang guard, not a timing claim: the timeout only bounds a test that would otherwise hang.
Polling is on purpose: the states waited for (a replica's queue, a ledger in Redis, a gauge)
offer no event to wait on.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

Predicate = Callable[[], bool | Awaitable[bool]]


async def holds(predicate: Predicate) -> bool:
    """`predicate()`, awaited when it is a coroutine function's."""
    value = predicate()
    if inspect.isawaitable(value):
        value = await value
    return bool(value)


async def eventually(
    predicate: Predicate, timeout_s: float = 10.0, *, what: str = "condition",
    interval_s: float = 0.01,
) -> None:
    """Until `predicate()` holds, checked every `interval_s`; AssertionError naming `what`
    once `timeout_s` has passed without it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await holds(predicate):
        if loop.time() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s:g} s")
        await asyncio.sleep(interval_s)

