"""Routing in front of simulated replicas on real sockets: bounded load for a dominant system
prompt, failover when a replica dies or answers 500s, drain, and session bindings shared
through Redis by two instances and kept across a restart."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from kvgate.config import SessionsConfig
from kvgate.request.parsed import Endpoint, parse_body
from kvgate.routing.sessions import Sessions, session_key
from kvgate.sim.faults import Faults
from kvgate.state.redis import RedisStore
from tests.plugins import bodies, client
from tests.plugins.bodies import SIM_MODEL
from tests.plugins.gateway import RunningGateway, gateway_config, wait_released
from tests.plugins.metrics import sample_value
from tests.plugins.waiting import eventually

SIM = dict(num_gpu_blocks=512, max_model_len=4096, time_scale=0.02, output_len_dist="max")
SYSTEM = "You are the support assistant of a bicycle shop."


def chat(text: str, max_tokens: int = 16) -> dict[str, Any]:
    return bodies.chat(text, model=SIM_MODEL, max_tokens=max_tokens, system_prompt=SYSTEM)


async def post(
    http: aiohttp.ClientSession, gw: RunningGateway, body: dict[str, Any], session: str | None = None
) -> tuple[int, str | None]:
    headers = {"X-Session-Id": session} if session else {}
    reply = await client.post(f"{gw.url}/v1/chat/completions", body, http=http, headers=headers)
    return reply.status, reply.headers.get("X-Kvgate-Replica")


async def exported(gw: RunningGateway, line: str) -> None:
    """Until /metrics has `line` (gauges are refreshed once a second)."""
    await eventually(lambda: line in gw.gateway.metrics.render().decode(), timeout_s=5.0)


def names(sims: list[Any]) -> list[dict[str, str]]:
    return [{"url": s.url, "name": f"r{i}"} for i, s in enumerate(sims)]


async def test_one_dominant_system_prompt_spreads_within_the_bounded_load(
    sim_factory, gateway_factory
):
    sims = [await sim_factory(**{**SIM, "time_scale": 0.2}, seed=i) for i in range(4)]
    gw = await gateway_factory(gateway_config(
        [], pools={"default": {"replicas": names(sims)}},
        routing={"scorers": {"prefix_affinity": 1}, "load_floor": 0.0},
        admission={"mode": "worst_case", "queue": {"max_wait_s": 60}},
    ))
    admission = gw.gateway.admission
    samples: list[list[int]] = []
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(post(http, gw, chat(f"question {i}", 200))) for i in range(48)]
        while not all(t.done() for t in tasks):
            samples.append([admission.reserved.get(f"r{i}", 0) for i in range(4)])
            await asyncio.sleep(0.005)
        results = [t.result() for t in tasks]
    assert all(status == 200 for status, _ in results)
    used = {replica for _, replica in results}
    assert used == {"r0", "r1", "r2", "r3"}  # one prefix, yet every replica took a share
    # at the peak, when all 48 were placed at once, no replica held more than 1.25 × a fair
    # quarter (plus one request: the grain a placement moves in)
    request_blocks = -(-(40 + 200) // 16)  # about: the system prompt, a question, max_tokens
    peak_total = max(sum(reserved) for reserved in samples)
    peaks = [max(reserved[i] for reserved in samples) for i in range(4)]
    assert max(peaks) <= 1.25 * peak_total / 4 + request_blocks, (peaks, peak_total)
    await wait_released(gw)


async def test_a_killed_replica_costs_no_request_that_had_not_begun_streaming(
    sim_factory, gateway_factory
):
    sims = [await sim_factory(**{**SIM, "time_scale": 0.05}, seed=i) for i in range(3)]
    gw = await gateway_factory(gateway_config([], pools={"default": {"replicas": names(sims)}}))
    failures_before_any_byte = []
    cut_mid_stream = 0
    ok = 0

    async def turn(http: aiohttp.ClientSession, session: str, i: int) -> None:
        nonlocal cut_mid_stream, ok
        body = {**chat(f"{session} turn {i}", 48), "stream": True}
        received = b""
        async with http.post(f"{gw.url}/v1/chat/completions", json=body,
                             headers={"X-Session-Id": session}) as resp:
            if resp.status != 200:
                failures_before_any_byte.append(resp.status)
                return
            async for chunk in resp.content.iter_any():
                received += chunk
        if received.endswith(b"data: [DONE]\n\n") and b'"error"' not in received:
            ok += 1
        else:
            cut_mid_stream += 1  # it had begun streaming: kvgate may not retry it

    async def conversation(http: aiohttp.ClientSession, session: str) -> None:
        for i in range(6):
            await turn(http, session, i)

    async with aiohttp.ClientSession() as http:
        chats = [asyncio.create_task(conversation(http, f"chat-{c}")) for c in range(12)]
        await eventually(lambda: ok >= 12)
        await sims[0].stop_for(None)  # killed: connections refused, streams cut
        await asyncio.gather(*chats)
    assert failures_before_any_byte == []
    assert ok + cut_mid_stream == 72 and ok >= 60
    text = gw.gateway.metrics.render().decode()
    assert 'kvgate_session_routes_total{reason="bound",result="hit"}' in text
    rebound = [line for line in text.splitlines()
               if line.startswith("kvgate_session_routes_total") and 'result="rebound"' in line]
    assert rebound, "the killed replica's sessions were rebound"
    await wait_released(gw)


async def test_a_replica_answering_500s_is_ejected_then_readmitted_after_a_trial(
    sim_factory, gateway_factory
):
    bad, good = await sim_factory(**SIM, seed=1), await sim_factory(**SIM, seed=2)
    gw = await gateway_factory(gateway_config(
        [], pools={"default": {"replicas": names([bad, good])}},
        routing={"scorers": {"round_robin": 1}, "circuit": {"failure_threshold": 2,
                                                            "open_s": 1.5}},
    ))
    await bad.set_faults(Faults(error_rate=1.0))
    async with aiohttp.ClientSession() as http:
        served = [await post(http, gw, chat(f"q{i}")) for i in range(6)]
        # every request answered: the ones sent to r0 went once more, to r1
        assert served == [(200, "r1")] * 6
        assert gw.gateway.breakers.state("r0") == "open"
        async with http.get(f"{gw.url}/admin/replicas") as resp:
            view = {r["id"]: r for r in orjson.loads(await resp.read())["replicas"]}
        assert view["r0"]["circuit"] == "open"
        await exported(gw, 'kvgate_replica_circuit_state{replica="r0"} 2.0')
        text = gw.gateway.metrics.render().decode()
        assert 'kvgate_upstream_retries_total{pool="default",reason="upstream_error"} 2.0' in text
        await bad.set_faults(Faults())
        # after open_s, the next request r0 gets is the trial
        await eventually(lambda: gw.gateway.breakers.state("r0") == "half_open")
        later = [await post(http, gw, chat(f"later {i}")) for i in range(4)]
    assert all(status == 200 for status, _ in later)
    assert "r0" in {replica for _, replica in later}
    assert gw.gateway.breakers.state("r0") == "closed"
    await wait_released(gw)


async def test_a_stream_cut_after_it_began_is_not_retried(sim_factory, gateway_factory):
    sim = await sim_factory(**SIM, faults={"drop_after_chunks": 2})
    other = await sim_factory(**SIM, seed=3)
    gw = await gateway_factory(gateway_config(
        [], pools={"default": {"replicas": names([sim, other])}},
        routing={"scorers": {"round_robin": 1}},
    ))
    cut = 0
    async with aiohttp.ClientSession() as http:
        for i in range(2):  # round robin: one of the two goes to the dropping replica
            body = {**chat(f"q{i}", 16), "stream": True}
            status, headers, raw = await client.post(f"{gw.url}/v1/chat/completions", body,
                                                     http=http)
            assert status == 200
            if headers["X-Kvgate-Replica"] == "r0":
                assert b'"error"' in raw  # told in-band; never sent twice
                cut += 1
    assert cut == 1
    assert "kvgate_upstream_retries_total{" not in gw.gateway.metrics.render().decode()
    await wait_released(gw)


async def test_drain_takes_no_new_requests_lets_in_flight_ones_finish_and_rebinds_sessions(
    sim_factory, gateway_factory
):
    sims = [await sim_factory(**{**SIM, "time_scale": 0.05}, seed=i) for i in range(2)]
    gw = await gateway_factory(gateway_config([], pools={"default": {"replicas": names(sims)}}))
    async with aiohttp.ClientSession() as http:
        status, home = await post(http, gw, chat("first"), session="s1")
        assert status == 200 and home is not None
        slow = asyncio.create_task(post(http, gw, chat("long answer", 300), session="s1"))
        await eventually(lambda: gw.gateway.registry.get(home).inflight)
        async with http.post(f"{gw.url}/admin/replicas/{home}/drain") as resp:
            assert resp.status == 200 and (await resp.json())["draining"] is True
        after = [await post(http, gw, chat(f"next {i}"), session="s1") for i in range(3)]
        assert all(status == 200 and replica != home for status, replica in after)
        assert await slow == (200, home)  # in flight when the drain began: it finished there
        text = gw.gateway.metrics.render().decode()
        assert 'kvgate_session_routes_total{reason="draining",result="rebound"} 1.0' in text
        await exported(gw, f'kvgate_replica_draining{{replica="{home}"}} 1.0')
        async with http.post(f"{gw.url}/admin/replicas/{home}/undrain") as resp:
            assert (await resp.json())["draining"] is False
        async with http.post(f"{gw.url}/admin/replicas/nope/drain") as resp:
            assert resp.status == 404
    await wait_released(gw)


@pytest.fixture
async def shared_redis(redis_url: str, key_prefix: str) -> dict[str, Any]:
    return {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix}


def stored_session(header_value: str) -> str:
    """The store key kvgate binds the anonymous tenant's session `header_value` under."""
    parsed = parse_body(orjson.dumps(chat("x")), Endpoint.CHAT)
    key = session_key(parsed, {"X-Session-Id": header_value}, SessionsConfig(), "anonymous")
    assert key is not None
    return Sessions.store_key(key)


async def test_bindings_are_shared_by_two_instances_and_survive_a_restart(
    sim_factory, gateway_factory, shared_redis, redis_url, key_prefix
):
    sims = [await sim_factory(**SIM, seed=i) for i in range(3)]

    def config() -> Any:
        return gateway_config([], pools={"default": {"replicas": names(sims)}},
                              state=shared_redis,
                              routing={"scorers": {"session": 4, "round_robin": 1}})

    store = RedisStore(redis_url, key_prefix=key_prefix)
    first, second = await gateway_factory(config()), await gateway_factory(config())
    try:
        async with aiohttp.ClientSession() as http:
            _, hashed = await post(http, first, chat("hello"), session="shared-chat")
            # move the binding where the session key's own hash order would not send it: from
            # here on only the binding in Redis can bring the session there
            home = next(f"r{i}" for i in range(3) if f"r{i}" != hashed)
            key = stored_session("shared-chat")
            assert await store.bind(key, home, 60, replace=hashed) == home
            served = [await post(http, second, chat(f"turn {i}"), session="shared-chat")
                      for i in range(4)]
            assert served == [(200, home)] * 4
            await first.runner.cleanup()
            await second.runner.cleanup()
            restarted = await gateway_factory(config())
            assert await post(http, restarted, chat("back"), session="shared-chat") == (200, home)
        assert await store.lookup(key) == home
    finally:
        await store.close()


async def test_a_half_open_replica_takes_one_trial_not_a_burst(sim_factory, gateway_factory):
    bad, good = await sim_factory(**SIM, seed=1), await sim_factory(**SIM, seed=2)
    gw = await gateway_factory(gateway_config(
        [], pools={"default": {"replicas": names([bad, good])}},
        routing={"scorers": {"least_loaded": 1}, "circuit": {"failure_threshold": 1,
                                                             "open_s": 0.5}},
    ))
    await bad.set_faults(Faults(error_rate=1.0))
    async with aiohttp.ClientSession() as http:
        while gw.gateway.breakers.state("r0") != "open":
            assert (await post(http, gw, chat("trip")))[0] == 200  # retried on r1
        # recovered, but slow to answer: the trial holds the circuit half open meanwhile
        await bad.set_faults(Faults(latency_s=0.5))
        await eventually(lambda: gw.gateway.breakers.state("r0") == "half_open")
        burst = await asyncio.gather(*(post(http, gw, chat(f"b{i}")) for i in range(10)))
    assert all(status == 200 for status, _ in burst)
    assert [replica for _, replica in burst].count("r0") == 1  # the trial, and no one else
    assert gw.gateway.breakers.state("r0") == "closed"
    await wait_released(gw)


async def test_a_session_waiting_for_its_replica_does_not_hold_up_other_requests(
    sim_factory, gateway_factory
):
    sims = [await sim_factory(**{**SIM, "num_gpu_blocks": 64, "max_model_len": 1000,
                                 "time_scale": 0.05}, seed=i)
            for i in range(2)]
    gw = await gateway_factory(gateway_config(
        [], pools={"default": {"replicas": names(sims)}},
        admission={"mode": "worst_case", "queue": {"max_wait_s": 10}},
        # a loose bound: the session keeps its full replica, and waits for it
        routing={"sessions": {"sources": ["header"], "affinity_wait_s": 2.0}, "load_factor": 10},
    ))
    admissions = gw.gateway.metrics.admissions
    async with aiohttp.ClientSession() as http:
        _, home = await post(http, gw, chat("hello"), session="s1")
        other = "r1" if home == "r0" else "r0"
        # fill the session's replica: 57 of its 57 admissible blocks, for a while
        filler = asyncio.create_task(post(http, gw, {**chat("fill", 880), "messages": [
            {"role": "user", "content": "x"}]}, session="s1"))
        await eventually(lambda: gw.gateway.admission.reserved.get(home, 0) >= 50)
        held = asyncio.create_task(post(http, gw, chat("turn 2"), session="s1"))
        await eventually(lambda: len(gw.gateway.admission.pool("default").queue) == 1)
        before = sample_value(admissions, "default", other, "no")
        assert await post(http, gw, chat("no session")) == (200, other)
        # placed at once, not queued behind the session's request
        assert sample_value(admissions, "default", other, "no") == before + 1
        assert not held.done()
        await filler
        assert (await held)[0] == 200
    await wait_released(gw)


async def test_a_drain_through_one_instance_drains_the_replica_on_every_instance(
    sim_factory, gateway_factory, shared_redis
):
    sims = [await sim_factory(**SIM, seed=i) for i in range(2)]

    def config() -> Any:
        return gateway_config([], pools={"default": {"replicas": names(sims)}},
                              state=shared_redis)

    first, second = await gateway_factory(config()), await gateway_factory(config())
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{first.url}/admin/replicas/r0/drain") as resp:
            assert resp.status == 200
        await eventually(lambda: second.gateway.registry.get("r0").draining)
        served = {replica for _, replica in
                  [await post(http, second, chat(f"q{i}")) for i in range(4)]}
        assert served == {"r1"}
        await second.runner.cleanup()
        restarted = await gateway_factory(config())  # the flag outlives an instance
        await eventually(lambda: restarted.gateway.registry.get("r0").draining)
        async with http.post(f"{restarted.url}/admin/replicas/r0/undrain") as resp:
            assert resp.status == 200
        await eventually(lambda: not first.gateway.registry.get("r0").draining)
