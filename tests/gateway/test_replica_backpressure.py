"""vLLM refusing work itself (`--max-num-queued-reqs`, `--max-num-queued-tokens`: 503) is
backpressure from a healthy replica, not a failure: its circuit stays closed, the request goes
to another replica or waits in kvgate's queue for room, and a client that cannot be served in
time gets kvgate's own 429 with Retry-After, never the 503 or a 502. Every test ends with
everything released (`wait_released`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from kvgate.config import Config
from kvgate.sim.faults import Faults
from kvgate.sim.server import SimReplica
from tests.plugins import bodies, client
from tests.plugins.bodies import SIM_MODEL
from tests.plugins.client import Reply
from tests.plugins.gateway import (
    RunningGateway,
    StubUpstream,
    gateway_config,
    openai_error,
    wait_released,
)
from tests.plugins.waiting import eventually

SIM = dict(num_gpu_blocks=512, max_model_len=4096, time_scale=0.02, output_len_dist="max")
# Real time: a long answer decodes for seconds (about 6 ms a token), so it is in flight.
SLOW = {**SIM, "time_scale": 1.0}
SimFactory = Callable[..., Awaitable[SimReplica]]
GatewayFactory = Callable[..., Awaitable[RunningGateway]]


def chat(text: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return bodies.chat(text, model=SIM_MODEL, max_tokens=max_tokens, **extra)


async def post(http: aiohttp.ClientSession, gw: RunningGateway, body: dict[str, Any]) -> Reply:
    return await client.post(f"{gw.url}/v1/chat/completions", body, http=http)


def rejections(gw: RunningGateway, replica: str, reason: str = "max_num_queued_reqs") -> float:
    value = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_replica_admission_rejections_total", {"replica": replica, "reason": reason}
    )
    return value or 0.0


def names(sims: list[SimReplica]) -> list[dict[str, str]]:
    return [{"url": s.url, "name": f"r{i}"} for i, s in enumerate(sims)]


def one_replica(sim: SimReplica, discovery_s: float = 0.1, **admission: Any) -> Config:
    return gateway_config(
        [], pools={"default": {"replicas": names([sim])}},
        admission=admission,
        routing={"circuit": {"failure_threshold": 2, "open_s": 60}},
        discovery={"interval_s": discovery_s, "timeout_s": 1.0},
    )


async def test_a_replica_refusing_as_busy_is_never_ejected_while_real_5xx_still_open_its_circuit(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    sim = await sim_factory(**SIM, max_num_queued_reqs=0)  # refuses everything as busy
    # Discovery once, at the start: its next read of /v1/models, answered 500 once the replica
    # is broken below, would mark it unhealthy before the requests could open its circuit.
    gw = await gateway_factory(one_replica(
        sim, discovery_s=60, busy_backoff_s=0.01, queue={"max_wait_s": 0.3},
    ))
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(
            *(post(http, gw, chat(f"q{i}", stream=i % 2 == 1)) for i in range(6))
        )
        for status, headers, raw in answers:
            assert status == 429, raw
            assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
            assert openai_error(raw)["code"] == "queue_timeout"
        # each was tried again whenever the busy mark lapsed: many 503s, over the threshold of 2
        assert rejections(gw, "r0") >= 6
        assert gw.gateway.breakers.state("r0") == "closed"
        await sim.set_faults(Faults(error_rate=1.0))  # now really broken: 500s
        for i in range(2):
            status, _, raw = await post(http, gw, chat(f"broken {i}"))
            assert status == 502, raw
    assert gw.gateway.breakers.state("r0") == "open"
    await wait_released(gw)


async def test_a_request_refused_as_busy_is_served_by_another_replica(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    busy, free = await sim_factory(**SIM, max_num_queued_reqs=0), await sim_factory(**SIM, seed=1)
    gw = await gateway_factory(gateway_config(
        [], pools={"default": {"replicas": names([busy, free])}},
        # equal scores rank by id: every request tries r0 first while it is not marked busy
        routing={"scorers": {"least_loaded": 1}},
        admission={"busy_backoff_s": 0.01},
    ))
    backpressure = gw.gateway.admission.backpressure
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            await eventually(lambda: not backpressure.busy("r0"))
            status, headers, raw = await post(http, gw, chat(f"q{i}", stream=i % 2 == 1))
            assert status == 200, raw
            assert headers["x-kvgate-replica"] == "r1"
            if i % 2:
                assert raw.endswith(b"data: [DONE]\n\n")
    assert rejections(gw, "r0") == 4
    retries = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_upstream_retries_total", {"pool": "default", "reason": "upstream_error"}
    )
    assert retries is None  # not a failure: no failover attempt was spent on it
    assert gw.gateway.breakers.state("r0") == "closed"
    await wait_released(gw)


async def test_with_one_replica_a_request_refused_as_busy_waits_and_completes_once_room_frees(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    sim = await sim_factory(**SLOW, max_num_queued_reqs=1)
    # no lapse during the test: only the first request's end lets the second try again
    gw = await gateway_factory(one_replica(
        sim, busy_backoff_s=60, queue={"max_wait_s": 20},
    ))
    async with aiohttp.ClientSession() as http:
        first = await http.post(f"{gw.url}/v1/chat/completions",
                                json=chat("a long one", 200, stream=True))
        assert first.status == 200
        await first.content.readuntil(b"\n\n")  # it runs on the replica
        second = asyncio.ensure_future(post(http, gw, chat("a short one", 4)))
        await eventually(lambda: rejections(gw, "r0") == 1)
        async with http.get(f"{gw.url}/admin/replicas") as resp:
            (view,) = orjson.loads(await resp.read())["replicas"]
        assert view["busy"] is True and view["circuit"] == "closed"
        assert (await first.read()).endswith(b"data: [DONE]\n\n")
        status, _, raw = await second
    assert status == 200, raw
    assert orjson.loads(raw)["usage"]["completion_tokens"] == 4
    assert rejections(gw, "r0") == 1  # it tried again only once room had freed
    assert gw.gateway.breakers.state("r0") == "closed"
    await wait_released(gw)


async def test_with_one_replica_busy_past_the_wait_budget_the_client_gets_429_with_retry_after(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    # steps slept out 1000x: the first request stays in prefill, its prompt over the limit
    sim = await sim_factory(**{**SIM, "time_scale": 1000.0}, max_num_queued_tokens=1)
    gw = await gateway_factory(one_replica(
        sim, busy_backoff_s=60, queue={"max_wait_s": 0.3},
    ))
    async with aiohttp.ClientSession() as http:
        first = await http.post(f"{gw.url}/v1/chat/completions",
                                json=chat("in prefill", 100, stream=True))
        assert first.status == 200
        for stream in (False, True):
            status, headers, raw = await post(http, gw, chat("no room", 4, stream=stream))
            assert status == 429, raw
            assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
            assert openai_error(raw)["code"] == "queue_timeout"
        first.close()
    # the second never reached the replica: marked busy, it waited in kvgate's queue
    assert rejections(gw, "r0", "max_num_queued_tokens") == 1
    assert gw.gateway.breakers.state("r0") == "closed"
    await wait_released(gw)


async def test_a_client_that_leaves_while_queued_after_a_busy_answer_leaves_nothing_held(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    sim = await sim_factory(**{**SIM, "time_scale": 1000.0}, max_num_queued_tokens=1)
    gw = await gateway_factory(one_replica(
        sim, busy_backoff_s=60, queue={"max_wait_s": 20},
    ))
    queue = gw.gateway.admission.pool("default").queue
    async with aiohttp.ClientSession() as http:
        first = await http.post(f"{gw.url}/v1/chat/completions",
                                json=chat("in prefill", 100, stream=True))
        assert first.status == 200
        second = asyncio.ensure_future(post(http, gw, chat("waits", 4, stream=True)))
        await eventually(lambda: rejections(gw, "r0", "max_num_queued_tokens") == 1)
        await eventually(lambda: len(queue) == 1)
        second.cancel()  # the client hangs up while waiting for room
        with contextlib.suppress(asyncio.CancelledError):
            await second
        first.close()
    await wait_released(gw)
    assert rejections(gw, "r0", "max_num_queued_tokens") == 1


async def test_the_replicas_rising_admission_rejections_make_its_overcommit_back_off(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    sim = await sim_factory(**SIM, max_num_queued_reqs=0)
    gw = await gateway_factory(one_replica(sim, queue={"max_wait_s": 0.3}))
    replica = next(iter(gw.gateway.registry))
    await eventually(lambda: replica.scrape is not None and replica.scrape.admission_rejections == 0)
    async with aiohttp.ClientSession() as http:
        status, _, _ = await post(http, gw, chat("refused"))
    assert status == 429
    # discovery scrapes vllm:admission_rejections_total every 0.1 s
    await eventually(lambda: gw.gateway.admission.overcommit.factor("r0") < 1.0)
    assert replica.scrape is not None and replica.scrape.admission_rejections
    await wait_released(gw)


async def test_without_admission_a_busy_replica_is_skipped_and_all_busy_is_429(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    busy = await sim_factory(**SIM, max_num_queued_reqs=0)
    one_at_a_time = await sim_factory(**SLOW, max_num_queued_reqs=1, seed=1)
    gw = await gateway_factory(gateway_config(
        [], pools={"default": {"replicas": names([busy, one_at_a_time])}},
        routing={"scorers": {"least_loaded": 1}},
        admission={"enabled": False, "busy_backoff_s": 60},
    ))
    async with aiohttp.ClientSession() as http:
        first = await http.post(f"{gw.url}/v1/chat/completions",
                                json=chat("a long one", 2000, stream=True))
        assert (first.status, first.headers["X-Kvgate-Replica"]) == (200, "r1")
        status, headers, raw = await post(http, gw, chat("no room anywhere"))
        assert status == 429, raw
        assert openai_error(raw)["code"] == "replicas_busy"
        assert 50 <= int(headers["retry-after"]) <= 60  # when the refusals stop counting
        first.close()
    assert (rejections(gw, "r0"), rejections(gw, "r1")) == (1, 1)
    assert gw.gateway.breakers.state("r0") == gw.gateway.breakers.state("r1") == "closed"
    await wait_released(gw)


async def test_a_503_that_is_not_vllms_overload_answer_counts_against_the_circuit(
    stub_factory: Callable[..., Awaitable[StubUpstream]], gateway_factory: GatewayFactory
) -> None:
    # a proxy's page, and vLLM's retryable generation error (another type): failures both
    bodies = [b"<html>503 Service Temporarily Unavailable</html>", orjson.dumps({"error": {
        "message": "Request failed; please retry", "type": "ServiceUnavailableError",
        "param": None, "code": 503}})]
    for body in bodies:
        stub = await stub_factory(status=503, error_body=body)
        gw = await gateway_factory(gateway_config(
            [stub.url], routing={"circuit": {"failure_threshold": 2, "open_s": 60}},
        ))
        replica = next(iter(gw.gateway.registry)).id
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                status, _, _ = await post(http, gw, {**chat("x"), "model": "stub-model"})
                assert status == 503
        assert gw.gateway.breakers.state(replica) == "open"
        assert rejections(gw, replica) == 0
        await wait_released(gw)
