"""Each injected fault, set from Python and through `/sim/faults`, seen by a real client."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvgate.sim.faults import Faults
from kvgate.sim.server import SimReplica
from tests.plugins import client
from tests.plugins.sim import SimFactory
from tests.plugins.waiting import eventually
from tests.sim.helpers import FAST

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def post_chat(http: aiohttp.ClientSession, replica: SimReplica, **extra: Any) -> int:
    reply = await client.post(replica.url + "/v1/chat/completions", {**CHAT, **extra}, http=http)
    return reply.status


async def test_faults_are_set_read_merged_and_cleared_over_http(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    async with http.post(replica.url + "/sim/faults", json={"error_rate": 0.25}) as response:
        assert (await response.json())["error_rate"] == 0.25
    async with http.post(replica.url + "/sim/faults", json={"latency_s": 0.01}) as response:
        assert response.status == 200
    async with http.get(replica.url + "/sim/faults") as response:
        current = await response.json()
    assert (current["error_rate"], current["latency_s"]) == (0.25, 0.01)
    assert replica.faults == Faults(error_rate=0.25, latency_s=0.01)
    async with http.post(replica.url + "/sim/faults", json={"nonsense": 1}) as response:
        assert response.status == 400
        assert "nonsense" in (await response.json())["error"]
    async with http.delete(replica.url + "/sim/faults") as response:
        assert await response.json() == Faults().to_dict()


async def test_added_latency_delays_the_answer(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    replica.faults = Faults(latency_s=0.3)
    pending = asyncio.ensure_future(post_chat(http, replica))
    await eventually(lambda: replica.held_by_faults == 1, what="the request held by the latency")
    assert not pending.done()
    assert await pending == 200


async def test_error_rate_answers_vllm_shaped_500s_reproducibly(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    async def statuses(replica: SimReplica) -> list[int]:
        return [await post_chat(http, replica) for _ in range(12)]

    first = await sim_factory(**FAST, seed=7, faults={"error_rate": 0.5})
    second = await sim_factory(**FAST, seed=7, faults={"error_rate": 0.5})
    pattern = await statuses(first)
    assert set(pattern) == {200, 500}
    assert await statuses(second) == pattern
    first.faults = Faults(error_rate=1.0)
    reply = await client.post(first.url + "/v1/chat/completions", CHAT, http=http)
    assert reply.status == 500
    error = reply.json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"


async def test_a_dropped_stream_ends_after_n_chunks_and_frees_the_blocks(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    replica.faults = Faults(drop_after_chunks=3)
    body = {**CHAT, "max_tokens": 50, "stream": True}
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
            async for data in response.content.iter_any():
                received += data
    assert received.count(b"data: ") == 3
    assert b"[DONE]" not in received
    await eventually(lambda: not replica.engine.has_unfinished_requests())
    assert replica.engine.pool.num_free_blocks == 255


async def test_a_dropped_full_response_closes_the_connection_without_an_answer(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    replica.faults = Faults(drop_after_chunks=0)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await post_chat(http, replica)
    replica.faults = Faults(drop_after_chunks=0, drop_rate=0.0)
    assert await post_chat(http, replica) == 200


async def test_a_hung_request_is_answered_once_the_fault_is_cleared(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    replica.faults = Faults(hang=True)
    pending = asyncio.ensure_future(post_chat(http, replica))
    await eventually(lambda: replica.held_by_faults == 1, what="the request hung")
    assert not pending.done()
    async with http.delete(replica.url + "/sim/faults") as response:
        assert response.status == 200
    assert await pending == 200


async def test_failing_health_answers_503(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    async with http.post(replica.url + "/sim/faults", json={"health_fail": True}) as response:
        assert response.status == 200
    async with http.get(replica.url + "/health") as response:
        assert response.status == 503
    replica.faults = Faults()
    async with http.get(replica.url + "/health") as response:
        assert response.status == 200


async def test_a_stopped_replica_refuses_connections_and_restarts_with_fresh_state(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    assert await post_chat(http, replica) == 200
    port = replica.port
    async with http.post(replica.url + "/sim/stop") as response:
        assert (await response.json())["stopping"] is True
    await eventually(lambda: not replica.running)
    with pytest.raises(aiohttp.ClientConnectorError):
        await post_chat(http, replica)
    await replica.restart()
    assert replica.port == port and not replica.faults.stopped
    assert replica.engine.stats.finished == 0
    assert await post_chat(http, replica) == 200


async def test_stop_with_restart_after_reopens_the_port_by_itself(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    async with http.post(replica.url + "/sim/stop", json={"restart_after_s": 0.2}) as response:
        assert response.status == 200
    await eventually(lambda: not replica.running)
    await eventually(lambda: replica.running)
    assert replica.starts == 2
    assert await post_chat(http, replica) == 200


async def test_stopped_through_faults_and_cleared_from_python(
    replica: SimReplica, http: aiohttp.ClientSession
) -> None:
    async with http.post(replica.url + "/sim/faults", json={"stopped": True}) as response:
        assert (await response.json())["stopped"] is True
    await eventually(lambda: not replica.running)
    await replica.set_faults(Faults())
    assert replica.running
    assert await post_chat(http, replica) == 200


async def test_restart_cuts_in_flight_streams_and_loses_engine_state(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(time_scale=0.5, num_gpu_blocks=256, max_model_len=1024)
    body = {**CHAT, "max_tokens": 500, "stream": True}
    response = await http.post(replica.url + "/v1/chat/completions", json=body)
    await response.content.readuntil(b"\n\n")
    async with http.post(replica.url + "/sim/restart") as answer:
        assert (await answer.json())["restarting"] is True
    with pytest.raises(aiohttp.ClientPayloadError):
        await response.read()
    response.release()
    await eventually(lambda: replica.starts == 2 and replica.running)
    assert not replica.engine.has_unfinished_requests()
    async with http.get(replica.url + "/sim/state") as answer:
        state = await answer.json()
    assert (state["steps"], state["starts"], state["free_blocks"]) == (0, 2, 255)


async def test_sim_state_lists_live_requests_on_demand(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(time_scale=0.5, num_gpu_blocks=256, max_model_len=1024)
    body = {**CHAT, "max_tokens": 500, "stream": True}
    async with http.post(
        replica.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "live-1"}
    ) as response:
        await response.content.readuntil(b"\n\n")
        async with http.get(replica.url + "/sim/state?requests=1") as answer:
            state = await answer.json()
    assert state["running"] == 1 and state["waiting"] == 0
    (live,) = state["requests"]
    assert live["id"] == "live-1" and live["status"] == "running" and live["blocks"] >= 1
    assert state["held_blocks"] == live["blocks"]

