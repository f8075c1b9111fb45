"""Priority where vLLM schedules: a pool whose replicas run `--scheduling-policy priority`
gets each request's class as vLLM's `priority`, so the critical class goes first in vLLM's
own queue; a pool that runs fcfs never gets one (vLLM would answer 400), and a client's own
is refused by kvgate, never forwarded."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kvgate.request.catalog import vllm_priority
from kvgate.request.rules import CLIENT_PRIORITY_SPAN
from kvgate.sim.stub import StubUpstream
from tests.plugins import client
from tests.plugins.bodies import SIM_MODEL, STUB_MODEL, chat
from tests.plugins.gateway import gateway_config, serve_app, wait_settled


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = [
    {"name": "bulk", "api_key_sha256": [sha("sk-bulk")], "priority": "sheddable"},
    {"name": "app", "api_key_sha256": [sha("sk-app")], "priority": "standard"},
    {"name": "vip", "api_key_sha256": [sha("sk-vip")], "priority": "critical"},
]


def config(sim_url: str, policy: str | None, model: str = SIM_MODEL) -> Any:
    pool: dict[str, Any] = {"replicas": [{"url": sim_url}]}
    if policy is not None:
        pool["scheduling_policy"] = policy
    return gateway_config(
        [sim_url], pools={"default": pool}, auth={"mode": "api_key"}, tenants=TENANTS,
        # vLLM's own queue is what this is about: kvgate lets it form
        admission={"max_replica_waiting": 10_000},
    )


async def post(
    session: aiohttp.ClientSession, url: str, key: str, model: str = SIM_MODEL, **fields: Any
) -> tuple[int, Any]:
    reply = await client.post(f"{url}/v1/chat/completions", chat(model=model, **fields),
                              http=session, headers={"Authorization": f"Bearer {key}"})
    return reply.status, reply.json()


def test_classes_map_to_vllm_priorities_in_order_and_a_client_orders_within_its_class() -> None:
    critical, standard, sheddable = (vllm_priority(c, None) for c in
                                     ("critical", "standard", "sheddable"))  # fmt: skip
    assert critical < standard == 0 < sheddable
    # a client's own value lowers its request within its class, never into the one above
    assert vllm_priority("critical", CLIENT_PRIORITY_SPAN - 1) < standard
    assert vllm_priority("standard", 5) > standard
    assert vllm_priority("standard", CLIENT_PRIORITY_SPAN - 1) < sheddable


async def finishing_order(sim_factory: Any, gateway_factory: Any, policy: str) -> list[str]:
    """vLLM runs one sequence at a time: six bulk requests queue in vLLM itself, then a
    critical request arrives; the order they finish in."""
    sim = await sim_factory(scheduling_policy=policy, max_num_seqs=1, time_scale=0.05)
    gw = await gateway_factory(config(sim.url, policy))
    finished: list[str] = []
    async with aiohttp.ClientSession() as session:

        async def one(key: str, name: str) -> None:
            status, body = await post(session, gw.url, key, max_tokens=40, text=name)
            assert status == 200, body
            finished.append(name)

        bulk = [asyncio.create_task(one("sk-bulk", f"bulk-{i}")) for i in range(6)]
        deadline = time.monotonic() + 10
        while len(sim.runtime.engine.waiting) < 4 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        assert len(sim.runtime.engine.waiting) >= 4  # queued in vLLM, not in kvgate
        await one("sk-vip", "vip")
        await asyncio.gather(*bulk)
    await wait_settled(gw)
    return finished


async def test_a_priority_pool_runs_the_critical_request_next(sim_factory, gateway_factory):
    """With the class sent as vLLM's priority, it runs ahead of every queued bulk request:
    at most the one running when it came finishes before it."""
    finished = await finishing_order(sim_factory, gateway_factory, "priority")
    assert finished.index("vip") <= 1, finished


async def test_on_fcfs_the_critical_request_waits_its_turn_in_vllm(sim_factory, gateway_factory):
    """The same run on fcfs: what the setting is for."""
    finished = await finishing_order(sim_factory, gateway_factory, "fcfs")
    assert finished.index("vip") >= 4, finished


@pytest.fixture
async def stub_gateway(gateway_factory: Any) -> AsyncIterator[Callable[[str | None], Any]]:
    """A gateway in front of the stub upstream, whose pool declares the policy given; the
    stub keeps every body it receives."""
    stubs: list[StubUpstream] = []

    async def make(policy: str | None) -> tuple[Any, StubUpstream]:
        stub = StubUpstream()
        stub.runner, stub.url = await serve_app(stub.app())
        stubs.append(stub)
        return await gateway_factory(config(stub.url, policy, model=STUB_MODEL)), stub

    yield make
    for stub in stubs:
        await stub.runner.cleanup()


@pytest.mark.parametrize("policy", [None, "fcfs", "priority"])
async def test_only_a_priority_pool_receives_a_priority_and_it_is_the_class(
    policy, stub_gateway
):
    """What each pool's replica receives from each class (the client sends none)."""
    gw, stub = await stub_gateway(policy)
    async with aiohttp.ClientSession() as session:
        for key in ("sk-vip", "sk-app", "sk-bulk"):
            status, body = await post(session, gw.url, key, model=STUB_MODEL)
            assert status == 200, body
    sent = [body.get("priority") for body in stub.received]
    if policy == "priority":
        assert sent == [vllm_priority(c, None) for c in ("critical", "standard", "sheddable")]
    else:
        assert sent == [None, None, None]
    await wait_settled(gw)


async def test_a_clients_own_priority_orders_it_within_its_class_on_a_priority_pool(
    stub_gateway
):
    gw, stub = await stub_gateway("priority")
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, gw.url, "sk-vip", model=STUB_MODEL, priority=7)
        assert status == 200, body
    assert stub.received[-1]["priority"] == vllm_priority("critical", 7)
    await wait_settled(gw)


async def test_a_declared_fcfs_pool_refuses_a_clients_priority_without_forwarding_it(
    stub_gateway
):
    """vLLM answers 400 to a non-zero priority under fcfs: kvgate says so itself."""
    gw, stub = await stub_gateway("fcfs")
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, gw.url, "sk-app", model=STUB_MODEL, priority=3)
        assert status == 400
        assert body["error"]["param"] == "priority"
        assert "fcfs" in body["error"]["message"]
        assert stub.received == []  # never forwarded
        status, body = await post(session, gw.url, "sk-app", model=STUB_MODEL, priority=0)
        assert status == 200, body  # vLLM's default passes
    await wait_settled(gw)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_a_long_vllm_queue_holds_the_critical_class_only_where_it_would_wait_there(
    policy, sim_factory, gateway_factory
):
    """kvgate's own limit on vLLM's queue (max_replica_waiting, 4 by default) keeps requests
    out of a queue they would wait in. On a priority pool the critical class runs ahead of
    that queue, so it is sent at once; on fcfs it would wait behind it, and waits in kvgate
    instead (ahead of every bulk request held there)."""
    sim = await sim_factory(scheduling_policy=policy, max_num_seqs=1, time_scale=0.1)
    gw = await gateway_factory(gateway_config(
        [sim.url], pools={"default": {"replicas": [{"url": sim.url}], "scheduling_policy": policy}},
        auth={"mode": "api_key"}, tenants=TENANTS, discovery={"interval_s": 0.05},
    ))
    (replica,), pool = gw.gateway.registry, gw.gateway.admission.pool("default")

    async def until(what: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not what() and time.monotonic() < deadline:  # noqa: ASYNC110 (polls state)
            await asyncio.sleep(0.005)
        assert what()

    async with aiohttp.ClientSession() as session:
        bulk = [asyncio.create_task(post(session, gw.url, "sk-bulk", max_tokens=200))
                for _ in range(8)]
        await until(lambda: replica.scrape is not None and (replica.scrape.waiting or 0) > 4)
        bulk += [asyncio.create_task(post(session, gw.url, "sk-bulk", max_tokens=200))
                 for _ in range(3)]
        await until(lambda: len(pool.queue) == 3)  # held in kvgate for vLLM's queue
        status, body = await post(session, gw.url, "sk-vip", max_tokens=5)
        assert status == 200, body
        results = await asyncio.gather(*bulk)
    assert all(status == 200 for status, _ in results)
    waits = gw.gateway.metrics.queue_wait.labels("default", "critical")
    waited = next(s.value for m in waits.collect() for s in m.samples if s.name.endswith("_sum"))
    await wait_settled(gw)
    assert (waited == 0.0) == (policy == "priority"), waited
