"""The Gateway API Inference Extension's request control headers mean in kvgate what they
mean behind a gateway, on kvgate's own port and through Envoy in full duplex alike:
`x-gateway-model-name-rewrite` serves the request as another model (routed, counted, admitted
and sent on as that model), `x-gateway-inference-objective` runs it in its objective's class
where that is lower than its tenant's (never higher), and `x-gateway-inference-fairness-id`
is a lane of the fair queue where kvgate knows no tenant; none reaches the replica."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import orjson
import pytest

from kvgate.request.catalog import vllm_priority
from tests.plugins import bodies, client
from tests.plugins.envoy import epp_config
from tests.plugins.gateway import gateway_config, openai_error, wait_released
from tests.plugins.waiting import eventually

REWRITE, OBJECTIVE = "x-gateway-model-name-rewrite", "x-gateway-inference-objective"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config(stub_url: str) -> Any:
    return epp_config(
        [stub_url], pools={"default": {"replicas": [{"url": stub_url}],
                                       "scheduling_policy": "priority"}},
        auth={"mode": "api_key"},
        tenants=[{"name": "vip", "api_key_sha256": [sha("sk-vip")], "priority": "critical"},
                 {"name": "bulk", "api_key_sha256": [sha("sk-bulk")], "priority": "sheddable"}],
        objectives={"offline-eval": "sheddable", "interactive": "critical"},
    )


@pytest.fixture(params=["kvgate", "envoy"])
async def url_and_stub(request, stub_factory, gateway_factory, envoy_factory):
    stub = await stub_factory(max_model_len=65_536, num_gpu_blocks=8192)  # long prompts fit
    gw = await gateway_factory(config(stub.url))
    if request.param == "kvgate":
        yield gw.url, stub
    else:
        envoy = await envoy_factory(gw, [stub], response_body="FULL_DUPLEX_STREAMED")
        yield envoy.url, stub
    await wait_released(gw)


async def post(url: str, body: dict[str, Any], key: str, **headers: str) -> tuple[int, bytes]:
    status, _, raw = await client.post(
        f"{url}/v1/chat/completions", orjson.dumps(body),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers},
    )
    return status, raw


async def test_a_rewritten_model_is_served_as_the_gateway_says(url_and_stub):
    url, stub = url_and_stub
    aliased = bodies.chat("hi", model="chat-latest", max_tokens=5)
    status, raw = await post(url, aliased, "sk-vip")
    assert status == 404 and openai_error(raw)["code"] == "model_not_found"  # no such model
    status, raw = await post(url, aliased, "sk-vip", **{REWRITE: bodies.STUB_MODEL})
    assert status == 200, raw
    # a body large enough to be parsed in a worker process is rewritten there too
    long = bodies.chat("lorem ipsum " * 12_000, model="chat-latest", max_tokens=5)
    status, raw = await post(url, long, "sk-vip", **{REWRITE: bodies.STUB_MODEL})
    assert status == 200, raw
    assert [body["model"] for body in stub.received] == [bodies.STUB_MODEL] * 2
    assert not any(REWRITE in seen for seen in stub.headers_seen)


async def test_an_objective_lowers_a_requests_class_and_never_raises_it(url_and_stub):
    url, stub = url_and_stub
    sent = [
        ("sk-vip", None, "critical"),
        ("sk-vip", "offline-eval", "sheddable"),  # the critical tenant's batch job
        ("sk-vip", "no-such-objective", "critical"),  # not configured: nothing changes
        ("sk-bulk", "interactive", "sheddable"),  # never above its tenant's
    ]
    for key, objective, _ in sent:
        headers = {OBJECTIVE: objective} if objective else {}
        status, raw = await post(url, bodies.chat(max_tokens=5), key, **headers)
        assert status == 200, raw
    # the pool schedules by priority: the class each ran in is the priority vLLM got
    assert [body["priority"] for body in stub.received] == [
        vllm_priority(cls, None) for _, _, cls in sent
    ]
    assert not any(OBJECTIVE in seen for seen in stub.headers_seen)


FAIRNESS = "x-gateway-inference-fairness-id"


@pytest.mark.parametrize("auth", ["none", "api_key"])
async def test_a_fairness_id_is_a_lane_of_the_queue_where_kvgate_knows_no_tenant(
    auth, stub_factory, gateway_factory
):
    """One stream at a time fits; flow A queues five behind its first, then flow B sends
    one. Behind a gateway that authenticates (kvgate sees no credential), each fairness id
    is a lane of the fair queue, and B's request goes next but one; a tenant kvgate knows is
    one lane whatever ids it sends, and B's request waits its turn behind A's five."""
    stub = await stub_factory(num_gpu_blocks=20, gate=asyncio.Event())
    tenants = [{"name": "acme", "api_key_sha256": [sha("sk-acme")]}]
    gw = await gateway_factory(gateway_config(
        [stub.url], auth={"mode": auth}, tenants=tenants if auth == "api_key" else [],
        admission={"mode": "worst_case", "queue": {"max_wait_s": 30}},
    ))
    queue = gw.gateway.admission.pool("default").queue

    async def send(text: str, flow: str) -> tuple[int, bytes]:
        return await post(gw.url, bodies.chat(text, max_tokens=200, stream=True), "sk-acme",
                          **{FAIRNESS: flow})  # fmt: skip

    first = asyncio.create_task(send("a0", "A"))
    await eventually(lambda: len(stub.received) == 1)  # running, held by the gate
    sent = [asyncio.create_task(send(f"a{i}", "A")) for i in range(1, 6)]
    await eventually(lambda: len(queue) == 5)
    sent.append(asyncio.create_task(send("b0", "B")))
    await eventually(lambda: len(queue) == 6)
    assert stub.gate is not None
    stub.gate.set()
    for status, raw in await asyncio.gather(first, *sent):
        assert status == 200, raw
    order = [body["messages"][-1]["content"] for body in stub.received]
    assert order.index("b0") == (2 if auth == "none" else 6), order
    assert not any(FAIRNESS in seen for seen in stub.headers_seen)
    await wait_released(gw)
