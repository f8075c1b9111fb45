"""The stream's idle timeout: a touch per chunk, one timer per idle period, and asyncio.timeout's
meaning — TimeoutError after `idle_s` with no touch or at the deadline; any other cancellation
stays a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.transport.idle import IdleTimeout


async def test_no_touch_for_the_idle_period_raises_timeout_error():
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with IdleTimeout(0.1, loop.time() + 60):
            await asyncio.sleep(5)
    assert 0.09 <= loop.time() - started < 4


async def test_touches_within_the_idle_period_keep_it_alive_past_many_periods():
    loop = asyncio.get_running_loop()
    async with IdleTimeout(0.2, loop.time() + 60) as idle:
        for _ in range(12):  # 0.6 s in all: three idle periods
            await asyncio.sleep(0.05)
            idle.touch()
    assert not idle.expired


async def test_the_deadline_ends_it_however_often_it_is_touched():
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with IdleTimeout(10, loop.time() + 0.2) as idle:
            while True:
                await asyncio.sleep(0.02)
                idle.touch()
    assert 0.19 <= loop.time() - started < 4


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    async def relay() -> None:
        async with IdleTimeout(10, asyncio.get_running_loop().time() + 60):
            await asyncio.sleep(5)

    task = asyncio.create_task(relay())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_one_timer_per_idle_period_not_one_per_touch():
    loop = asyncio.get_running_loop()
    scheduled = 0
    call_at = loop.call_at

    def counting(when, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal scheduled
        if getattr(callback, "__self__", None).__class__ is IdleTimeout:
            scheduled += 1
        return call_at(when, callback, *args, **kwargs)

    loop.call_at = counting  # type: ignore[method-assign]
    try:
        async with IdleTimeout(0.3, loop.time() + 60) as idle:
            for _ in range(2000):  # a fast stream: 2,000 chunks well within one period
                idle.touch()
                await asyncio.sleep(0)
    finally:
        del loop.call_at
    assert scheduled <= 2


async def test_it_expires_after_the_last_touch_not_the_first():
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        async with IdleTimeout(0.15, loop.time() + 60) as idle:
            await asyncio.sleep(0.1)
            idle.touch()
            touched = loop.time()
            await asyncio.sleep(5)
    assert loop.time() - touched >= 0.14


async def test_it_says_whether_the_idle_gap_or_the_deadline_ended_it():
    loop = asyncio.get_running_loop()
    for idle_s, deadline_s, reason in ((0.05, 60, "idle"), (10, 0.05, "deadline")):
        with pytest.raises(TimeoutError):
            async with IdleTimeout(idle_s, loop.time() + deadline_s) as idle:
                await asyncio.sleep(5)
        assert idle.reason == reason


def test_under_uvloop_an_expiry_between_its_millisecond_ticks_does_not_spin():
    # uvloop fires timers on whole milliseconds, possibly just before the time asked for; a
    # check that re-armed itself whenever the clock still read "before" ran hundreds of times.
    uvloop = pytest.importorskip("uvloop")
    checks = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        timeout = IdleTimeout(10, loop.time() + 0.0304567)  # between two ticks
        with pytest.raises(TimeoutError):
            async with timeout:
                await asyncio.sleep(5)
        checks.append(timeout.checks)

    uvloop.run(main())
    assert 1 <= checks[0] <= 3
