"""The check of tests/plugins/blocking.py catches a blocked event loop, wherever it blocks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from blockbuster import BlockingError

from kvgate.config import load_config
from tests.plugins.blocking import Blocked
from tests.plugins.gateway import serve_app


async def test_a_coroutine_that_sleeps_on_the_loop_is_caught(blockbuster: Blocked) -> None:
    with pytest.raises(BlockingError, match=r"time\.sleep"):
        time.sleep(0.001)  # noqa: ASYNC251 (blocking on purpose)
    assert [call.split()[0] for call in blockbuster.calls] == ["time.sleep"]
    blockbuster.calls.clear()


async def test_reading_a_file_on_the_loop_is_caught_in_a_thread_it_is_not(
    blockbuster: Blocked, tmp_path: Path
) -> None:
    path = tmp_path / "kvgate.yaml"
    await asyncio.to_thread(path.write_text, "pools: {}\n")  # a thread stalls nobody
    with pytest.raises(BlockingError):
        path.read_text()
    assert blockbuster.calls
    blockbuster.calls.clear()


async def test_kvgate_code_that_blocks_on_the_loop_is_caught(
    blockbuster: Blocked, tmp_path: Path
) -> None:
    path = tmp_path / "kvgate.yaml"
    await asyncio.to_thread(path.write_text, "pools: {}\n")
    with pytest.raises(BlockingError):
        load_config(path)
    blockbuster.calls.clear()


async def test_a_handler_that_blocks_is_recorded_though_the_client_only_sees_a_500(
    blockbuster: Blocked,
) -> None:
    async def sleepy(request: web.Request) -> web.Response:
        time.sleep(0.001)  # noqa: ASYNC251 (blocking on purpose)
        return web.Response()

    app = web.Application()
    app.router.add_get("/", sleepy)
    runner, url = await serve_app(app)
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 500
    finally:
        await runner.cleanup()
    assert [call.split()[0] for call in blockbuster.calls] == ["time.sleep"]
    blockbuster.calls.clear()


def test_a_sync_test_may_sleep_no_loop_runs() -> None:
    time.sleep(0.001)
