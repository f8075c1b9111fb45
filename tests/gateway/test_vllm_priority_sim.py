"""Priority where vLLM schedules: a pool whose replicas run `--scheduling-policy priority`
gets each request's class as vLLM's `priority`, so the critical class goes first in vLLM's
own queue; a pool that runs fcfs never gets one (vLLM would answer 400), and a client's own
is refused by kvgate, never forwarded."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import aiohttp
import pytest

from kvgate.request.catalog import vllm_priority
from kvgate.request.rules import CLIENT_PRIORITY_SPAN
from kvgate.sim.stub import StubUpstream
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
    async with session.post(f"{url}/v1/chat/completions", json=chat(model=model, **fields),
                            headers={"Authorization": f"Bearer {key}"}) as r:  # fmt: skip
        return r.status, await r.json()


def test_classes_map_to_vllm_priorities_in_order_and_a_client_orders_within_its_class() -> None:
    critical, standard, sheddable = (vllm_priority(c, None) for c in
                                     ("critical", "standard", "sheddable"))  # fmt: skip
    assert critical < standard == 0 < sheddable
    # a client's own value lowers its request within its class, never into the one above
    assert vllm_priority("critical", CLIENT_PRIORITY_SPAN - 1) < standard
    assert vllm_priority("standard", 5) > standard
    assert vllm_priority("standard", CLIENT_PRIORITY_SPAN - 1) < sheddable


async def test_a_priority_pool_receives_the_class_and_the_critical_request_runs_first(
    sim_factory, gateway_factory
):
    """vLLM runs one sequence at a time: the bulk tenant's requests queue in vLLM itself,
    then a critical request arrives. With the class sent as vLLM's priority it is the next
    to run, ahead of every queued bulk request."""
    sim = await sim_factory(scheduling_policy="priority", max_num_seqs=1, time_scale=0.05)
    gw = await gateway_factory(config(sim.url, "priority"))
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
    # the one bulk request running when it came, at most, finished before it
    assert finished.index("vip") <= 1, finished
    await wait_settled(gw)


async def test_without_the_priority_policy_the_critical_request_waits_its_turn(
    sim_factory, gateway_factory
):
    """The same run on fcfs: what the setting is for."""
    sim = await sim_factory(scheduling_policy="fcfs", max_num_seqs=1, time_scale=0.05)
    gw = await gateway_factory(config(sim.url, None))
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
        await one("sk-vip", "vip")
        await asyncio.gather(*bulk)
    assert finished.index("vip") >= 4, finished
    await wait_settled(gw)


@pytest.mark.parametrize("policy", [None, "fcfs", "priority"])
async def test_only_a_priority_pool_receives_a_priority_and_it_is_the_class(
    policy, gateway_factory
):
    """What each pool's replica receives from each class (the client sends none)."""
    stub = StubUpstream()
    stub.runner, stub.url = await serve_app(stub.app())
    try:
        gw = await gateway_factory(config(stub.url, policy, model=STUB_MODEL))
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
    finally:
        await stub.runner.cleanup()


async def test_a_clients_own_priority_orders_it_within_its_class_on_a_priority_pool(
    gateway_factory
):
    stub = StubUpstream()
    stub.runner, stub.url = await serve_app(stub.app())
    try:
        gw = await gateway_factory(config(stub.url, "priority", model=STUB_MODEL))
        async with aiohttp.ClientSession() as session:
            status, body = await post(session, gw.url, "sk-vip", model=STUB_MODEL, priority=7)
            assert status == 200, body
        assert stub.received[-1]["priority"] == vllm_priority("critical", 7)
        await wait_settled(gw)
    finally:
        await stub.runner.cleanup()


async def test_a_declared_fcfs_pool_refuses_a_clients_priority_without_forwarding_it(
    gateway_factory
):
    """vLLM answers 400 to a non-zero priority under fcfs: kvgate says so itself."""
    stub = StubUpstream()
    stub.runner, stub.url = await serve_app(stub.app())
    try:
        gw = await gateway_factory(config(stub.url, "fcfs", model=STUB_MODEL))
        async with aiohttp.ClientSession() as session:
            status, body = await post(session, gw.url, "sk-app", model=STUB_MODEL, priority=3)
            assert status == 400
            assert body["error"]["param"] == "priority"
            assert "fcfs" in body["error"]["message"]
            assert stub.received == []  # never forwarded
            status, body = await post(session, gw.url, "sk-app", model=STUB_MODEL, priority=0)
            assert status == 200, body  # vLLM's default passes
        await wait_settled(gw)
    finally:
        await stub.runner.cleanup()
