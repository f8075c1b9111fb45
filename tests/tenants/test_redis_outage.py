"""Redis stopped (killed) and restarted under load, in both failure modes.

fail_open: kvgate keeps answering from local in-memory limits, `kvgate_state_store_up` goes to
0 and back to 1 once Redis answers again. fail_closed: new requests get 503
state_store_unavailable at once (never a hang), and service comes back by itself. Neither mode
crashes kvgate, and once the load is over no ledger or concurrency lease is left held.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import pytest

from kvgate.state.redis import RedisStore
from tests.plugins.gateway import RunningGateway, gateway_config, openai_error, wait_released
from tests.plugins.redis_server import PrivateRedis
from tests.plugins.waiting import eventually
from tests.tenants.support import chat, concurrency_pool, metrics, post, sample

pytestmark = pytest.mark.redis

HANG_GUARD_S = 10.0  # far above any legitimate answer, far below the pytest timeout
WORKERS = 4


@dataclass(frozen=True)
class Answer:
    sent: float
    done: float
    status: int
    code: str | None


async def load(
    session: aiohttp.ClientSession, gw: RunningGateway, stop: asyncio.Event, out: list[Answer]
) -> None:
    while not stop.is_set():
        sent = time.monotonic()
        async with asyncio.timeout(HANG_GUARD_S):
            reply = await post(session, gw.url, chat(stream=True))
        code = openai_error(reply.body)["code"] if reply.status != 200 else None
        out.append(Answer(sent, time.monotonic(), reply.status, code))
        await asyncio.sleep(0.01)


async def store_up(session: aiohttp.ClientSession, gw: RunningGateway) -> float | None:
    return sample(await metrics(session, gw.url), "kvgate_state_store_up", backend="redis")


@dataclass(frozen=True)
class Outage:
    gw: RunningGateway
    answers: list[Answer]
    stopped: float  # Redis about to be killed
    restarted: float  # Redis answering again
    recovered: float  # kvgate reporting it up again


async def outage_under_load(
    mode: str, private_redis: PrivateRedis, key_prefix: str, stub_factory, gateway_factory
) -> Outage:
    """Run load, kill Redis until kvgate reports it down and some requests were answered,
    restart it, wait until kvgate reports it up and serves again."""
    stub = await stub_factory(chunks=3, delay_headers_s=0.05)  # requests overlap the kill
    gw = await gateway_factory(gateway_config(
        [stub.url],
        auth={"mode": "none", "anonymous_tenant": "team"},
        tenants=[{"name": "team", "tokens_per_minute": 1_000_000, "max_concurrent": 50}],
        state={"backend": "redis", "redis_url": private_redis.url, "key_prefix": key_prefix,
               "failure_mode": mode},
    ))
    answers: list[Answer] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as s:
        workers = [asyncio.ensure_future(load(s, gw, stop, answers)) for _ in range(WORKERS)]

        async def served(since: float, count: int = 10, ok_only: bool = True) -> bool:
            """At least `count` requests sent after `since` were answered (with 200)."""
            for worker in workers:  # a worker's unexpected answer or hang fails the test now
                if worker.done():
                    worker.result()
            return sum(
                1 for a in answers if a.sent > since and (a.status == 200 or not ok_only)
            ) >= count

        try:
            await eventually(lambda: served(0.0), what="load before the outage")
            assert await store_up(s, gw) == 1

            stopped = time.monotonic()
            await private_redis.stop()

            async def down() -> bool:
                return await store_up(s, gw) == 0

            await eventually(down, what="kvgate_state_store_up == 0")
            await eventually(lambda: served(stopped, ok_only=False),
                             what="requests answered during the outage")

            await private_redis.start()
            restarted = time.monotonic()

            async def up() -> bool:
                return await store_up(s, gw) == 1

            await eventually(up, what="kvgate_state_store_up == 1")
            recovered = time.monotonic()
            await eventually(lambda: served(restarted), what="requests served after the restart")
        finally:
            stop.set()
            ended = await asyncio.gather(*workers, return_exceptions=True)
        for result in ended:
            if isinstance(result, BaseException):
                raise result
        async with s.get(f"{gw.url}/health") as r:
            assert r.status == 200
    return Outage(gw, answers, stopped, restarted, recovered)


async def nothing_held(gw: RunningGateway, private_redis: PrivateRedis, key_prefix: str) -> None:
    """No ledger block or concurrency lease is held, as kvgate and as Redis itself see it."""
    pools = [f"ledger:{r.id}" for r in gw.gateway.registry] + [concurrency_pool("team")]
    redis = RedisStore(private_redis.url, key_prefix=key_prefix)
    try:
        for pool in pools:

            async def released(pool: str = pool) -> bool:
                return await gw.store.held(pool) == 0 and await redis.held(pool) == 0

            await eventually(released, what=f"{pool} released")
    finally:
        await redis.close()
    await wait_released(gw)  # and no lease kept, nothing queued, nothing in flight


async def test_fail_open_keeps_serving_through_a_redis_outage_and_reports_it(
    private_redis, key_prefix, stub_factory, gateway_factory
):
    run = await outage_under_load(
        "fail_open", private_redis, key_prefix, stub_factory, gateway_factory
    )
    assert [a for a in run.answers if a.status != 200] == []
    during = [a for a in run.answers if run.stopped < a.sent and a.done < run.restarted]
    assert len(during) >= 10
    async with aiohttp.ClientSession() as s:
        samples = await metrics(s, run.gw.url)
    assert sample(samples, "kvgate_state_store_fallback_calls_total", backend="redis") > 0
    assert sample(samples, "kvgate_state_store_outage_seconds_total", backend="redis") > 0
    assert sample(samples, "kvgate_state_store_errors_total", backend="redis") > 0
    assert sample(samples, "kvgate_state_store_latency_seconds", backend="redis") is not None
    await nothing_held(run.gw, private_redis, key_prefix)


async def test_fail_closed_refuses_with_503_during_a_redis_outage_and_recovers_by_itself(
    private_redis, key_prefix, stub_factory, gateway_factory
):
    run = await outage_under_load(
        "fail_closed", private_redis, key_prefix, stub_factory, gateway_factory
    )
    assert {a.status for a in run.answers} <= {200, 503}
    refused = [a for a in run.answers if a.status == 503]
    assert {a.code for a in refused} == {"state_store_unavailable"}
    assert len(refused) >= 5
    # Only while Redis was down (a request in flight at the kill may be refused too), and
    # never once kvgate saw it back.
    assert all(run.stopped < a.done and a.sent < run.recovered for a in refused), [
        (round(a.sent - run.stopped, 3), round(a.done - run.stopped, 3)) for a in refused
    ] + [round(run.recovered - run.stopped, 3)]
    async with aiohttp.ClientSession() as s:
        samples = await metrics(s, run.gw.url)
        after = await post(s, run.gw.url, chat())
    assert after.status == 200
    assert sample(samples, "kvgate_refusals_total", pool="default", tenant="team",
                  reason="state_store_unavailable") == len(refused)
    await nothing_held(run.gw, private_redis, key_prefix)
