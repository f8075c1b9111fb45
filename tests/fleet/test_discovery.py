"""Discovery's verdict: unhealthy means failing, not late. A replica leaves rotation after
`failure_threshold` failed checks in a row, at once when nothing listens, and never for a
check that came late while it answers requests (a real vLLM's API server, busy generating,
answers its checks late: tests/real)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from kvgate.config import ReplicaConfig
from kvgate.config.routing import DiscoveryConfig
from kvgate.fleet.discovery import discover
from kvgate.fleet.replicas import Replica
from tests.plugins.gateway import serve_app

CONFIG = DiscoveryConfig(interval_s=0.1, timeout_s=0.05, failure_threshold=3)


class Replying:
    """A replica whose /health answers after `delay_s`, or with `status`."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.status = 200

    def app(self) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            await asyncio.sleep(self.delay_s)
            return web.Response(status=self.status)

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        return app


@pytest.fixture
async def served() -> AsyncIterator[tuple[Replying, Replica, web.AppRunner]]:
    """A `Replying` server on a real socket, and the replica kvgate knows it as."""
    server = Replying()
    runner, url = await serve_app(server.app())
    yield server, Replica(ReplicaConfig(url=url), "default"), runner
    await runner.cleanup()


async def checked(replica: Replica, times: int) -> list[bool]:
    """Discovery's verdict after each of `times` checks."""
    seen = []
    async with aiohttp.ClientSession() as session:
        for _ in range(times):
            await discover(session, replica, CONFIG)
            seen.append(replica.healthy)
    return seen


async def test_a_replica_is_unhealthy_after_three_late_checks_in_a_row_not_one(served):
    server, replica, _ = served
    assert await checked(replica, 1) == [True]
    server.delay_s = 0.2
    assert await checked(replica, 3) == [True, True, False]
    assert replica.last_error is not None and replica.failed_checks == 3
    server.delay_s = 0.0  # answers in time again: back, and the count starts over
    assert await checked(replica, 1) == [True]
    server.delay_s = 0.2
    assert await checked(replica, 2) == [True, True]
    server.delay_s, server.status = 0.0, 500  # failing, not late: counted the same
    assert await checked(replica, 1) == [False]


async def test_a_late_check_while_the_replica_answers_requests_is_no_failure(served):
    server, replica, _ = served
    await checked(replica, 1)
    server.delay_s = 0.2
    for _ in range(5):
        replica.answered_at = time.monotonic()  # as the transport notes each answer
        assert await checked(replica, 1) == [True]
    assert replica.failed_checks == 0


async def test_nothing_listening_is_unhealthy_at_once(served):
    _, replica, runner = served
    assert await checked(replica, 1) == [True]
    await runner.cleanup()
    assert await checked(replica, 1) == [False]
    assert replica.failed_checks == 1
