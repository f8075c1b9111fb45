"""Replicas from an InferencePool, read through a fake Kubernetes API served over a real socket:
the ready pods its selector matches are its replicas (one per target port), a pod that stops
being ready drains, both versions of the resource are read, a failing API keeps the last
answer, the service account's token goes with every call; and a pool fed this way serves the
`openai` client through kvgate."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from kvgate.config import InferencePoolConfig, PoolConfig, ReplicaConfig, parse_config
from kvgate.fleet.inference_pool import KubeApi, pool_spec, read_pools, replica_configs
from kvgate.fleet.replicas import Registry
from tests.plugins.bodies import SIM_MODEL
from tests.plugins.gateway import gateway_config, serve_app
from tests.plugins.waiting import eventually

V1 = "inference.networking.k8s.io/v1"
ALPHA = "inference.networking.x-k8s.io/v1alpha2"


def pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True, app: str = "vllm",
        deleting: bool = False) -> dict[str, Any]:  # fmt: skip
    metadata: dict[str, Any] = {"name": name, "namespace": "llm", "labels": {"app": app}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-07T10:00:00Z"
    status: dict[str, Any] = {"conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"},
    ]}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": metadata, "status": status}


def v1_pool(ports: list[int], app: str = "vllm") -> dict[str, Any]:
    return {"apiVersion": V1, "kind": "InferencePool",
            "metadata": {"name": "vllm", "namespace": "llm"},
            "spec": {"selector": {"matchLabels": {"app": app}},
                     "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "kvgate-epp", "port": {"number": 9002}}}}  # fmt: skip


@dataclass
class FakeKube:
    """The two reads kvgate makes of the API, as the API server answers them: the pool (by
    group and version), and the pods a label selector matches (equality terms, as kvgate
    sends them). `status`: answer every call with it instead (an outage, missing RBAC)."""

    pools: dict[str, dict[str, Any]] = field(default_factory=dict)  # version -> resource
    pods: list[dict[str, Any]] = field(default_factory=list)
    token: str = "sa-token-1"
    status: int | None = None
    calls: list[str] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/apis/{group}/{version}/namespaces/{ns}/inferencepools/{name}",
                           self.pool)  # fmt: skip
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self.list_pods)
        return app

    def check(self, request: web.Request) -> web.Response | None:
        self.calls.append(request.path_qs)
        if self.status is not None:
            return web.json_response({"kind": "Status", "code": self.status}, status=self.status)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        return None

    async def pool(self, request: web.Request) -> web.Response:
        if (refused := self.check(request)) is not None:
            return refused
        version = f"{request.match_info['group']}/{request.match_info['version']}"
        found = self.pools.get(version)
        if found is None or request.match_info["name"] != found["metadata"]["name"]:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response(found)

    async def list_pods(self, request: web.Request) -> web.Response:
        if (refused := self.check(request)) is not None:
            return refused
        terms = dict(t.split("=", 1) for t in request.query["labelSelector"].split(","))
        items = [p for p in self.pods if p["metadata"]["namespace"] == request.match_info["ns"]
                 and all(p["metadata"]["labels"].get(k) == v for k, v in terms.items())]  # fmt: skip
        return web.json_response({"kind": "PodList", "items": items})


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    fake = FakeKube()
    runner, fake.url = await serve_app(fake.app())
    yield fake
    await runner.cleanup()


def source(kube: FakeKube, token_file: Path, **extra: Any) -> InferencePoolConfig:
    return InferencePoolConfig(name="vllm", namespace="llm", api_server=kube.url,
                               token_file=str(token_file), **extra)  # fmt: skip


async def one_round(registry: Registry, config: InferencePoolConfig) -> None:
    async with aiohttp.ClientSession() as session:
        api = KubeApi(session, config)

        async def read(pool: str, src: InferencePoolConfig) -> list[ReplicaConfig]:
            return await api.replicas(src.namespace or "default")

        await read_pools(registry, {"gpu": PoolConfig(inference_pool=config)}, read)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("sa-token-1\n")
    return path


async def test_the_ready_pods_the_selector_matches_are_the_replicas_and_one_unready_drains(
    kube: FakeKube, token_file: Path
) -> None:
    kube.pools[V1] = v1_pool([8000])
    kube.pods = [
        pod("vllm-a", "10.0.0.1"), pod("vllm-b", "10.0.0.2", ready=False),
        pod("vllm-c", "10.0.0.3", deleting=True), pod("vllm-d", None),
        pod("other", "10.0.0.9", app="redis"),
    ]
    config = source(kube, token_file)
    registry = Registry()
    registry.sync({"gpu": []}, found={"gpu"})
    await one_round(registry, config)
    (a,) = list(registry)
    assert (a.id, a.url, a.pool) == ("vllm-a", "http://10.0.0.1:8000", "gpu")
    # vllm-b turns ready, vllm-a stops being ready while a request still runs there
    kube.pods[0], kube.pods[1] = pod("vllm-a", "10.0.0.1", ready=False), pod("vllm-b", "10.0.0.2")
    a.inflight["a-request"] = object()  # type: ignore[assignment]
    await one_round(registry, config)
    assert registry.get("vllm-a") is a and a.draining
    assert sorted(r.id for r in registry if not r.draining) == ["vllm-b"]
    del a.inflight["a-request"]
    await one_round(registry, config)
    assert [r.id for r in registry] == ["vllm-b"]
    assert kube.calls[:2] == [f"/apis/{V1}/namespaces/llm/inferencepools/vllm",
                              "/api/v1/namespaces/llm/pods?labelSelector=app%3Dvllm"]  # fmt: skip


async def test_the_older_version_is_read_where_the_current_one_is_not_served_and_ports_count(
    kube: FakeKube, token_file: Path
) -> None:
    kube.pools[ALPHA] = {"apiVersion": ALPHA, "kind": "InferencePool",
                         "metadata": {"name": "vllm", "namespace": "llm"},
                         "spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8200,
                                  "extensionRef": {"name": "kvgate-epp"}}}  # fmt: skip
    kube.pods = [pod("vllm-a", "10.0.0.1")]
    registry = Registry()
    registry.sync({"gpu": []}, found={"gpu"})
    await one_round(registry, source(kube, token_file, scheme="https"))
    assert [(r.id, r.url) for r in registry] == [("vllm-a", "https://10.0.0.1:8200")]
    # v1 with several target ports (data-parallel ranks on port + rank): each is an endpoint
    kube.pools[V1] = v1_pool([8000, 8001])
    kube.pods = [pod("vllm-a", "fd00::7")]
    await one_round(registry, source(kube, token_file))
    assert sorted((r.id, r.url) for r in registry) == [
        ("vllm-a:8000", "http://[fd00::7]:8000"), ("vllm-a:8001", "http://[fd00::7]:8001"),
    ]


async def test_a_failing_api_keeps_the_last_answer_and_says_why(
    kube: FakeKube, token_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kube.pools[V1] = v1_pool([8000])
    kube.pods = [pod("vllm-a")]
    config = source(kube, token_file)
    registry = Registry()
    registry.sync({"gpu": []}, found={"gpu"})
    await one_round(registry, config)
    for status in (403, 500):  # RBAC missing; the API server failing
        kube.status = status
        with caplog.at_level(logging.WARNING, "kvgate.fleet.inference_pool"):
            await one_round(registry, config)
        assert [r.id for r in registry] == ["vllm-a"]
        assert f": {status} " in caplog.text and "keeping the last answer" in caplog.text
        caplog.clear()
    kube.status = None
    del kube.pools[V1]  # the pool was deleted: both versions 404
    with caplog.at_level(logging.WARNING, "kvgate.fleet.inference_pool"):
        await one_round(registry, config)
    assert "no InferencePool llm/vllm" in caplog.text and [r.id for r in registry] == ["vllm-a"]


async def test_the_token_is_read_afresh_each_round_as_the_kubelet_rotates_it(
    kube: FakeKube, token_file: Path
) -> None:
    kube.pools[V1] = v1_pool([8000])
    kube.pods = [pod("vllm-a")]
    registry = Registry()
    registry.sync({"gpu": []}, found={"gpu"})
    config = source(kube, token_file)
    kube.token = "sa-token-2"  # the API moved on: the old token is refused
    await one_round(registry, config)
    assert list(registry) == []
    await asyncio.to_thread(token_file.write_text, "sa-token-2")
    await one_round(registry, config)
    assert [r.id for r in registry] == ["vllm-a"]


def test_a_pool_spec_without_selector_or_port_is_refused() -> None:
    broken = copy.deepcopy(v1_pool([8000]))
    broken["spec"]["targetPorts"] = []
    with pytest.raises(Exception, match="no selector labels or no target port"):
        pool_spec(broken)
    assert replica_configs({"items": []}, pool_spec(v1_pool([1])), "http") == []


def test_a_pool_takes_one_source_of_found_replicas() -> None:
    with pytest.raises(ValueError, match="not both"):
        parse_config({"pools": {"gpu": {
            "dns": {"name": "vllm"}, "inference_pool": {"name": "vllm"},
        }}})
    config = parse_config({"pools": {"gpu": {"inference_pool": {"name": "vllm"}}}})
    found = config.pools["gpu"].found_by
    assert isinstance(found, InferencePoolConfig) and found.api_server is None


async def test_a_pool_fed_by_an_inference_pool_serves_the_openai_client(
    kube: FakeKube, token_file: Path, sim_factory: Any, gateway_factory: Any
) -> None:
    sim = await sim_factory(time_scale=0.01)
    port = int(sim.url.rsplit(":", 1)[1])
    kube.pools[V1] = v1_pool([port])
    kube.pods = [pod("vllm-0", "127.0.0.1")]
    config = gateway_config([], pools={"default": {"inference_pool": {
        "name": "vllm", "namespace": "llm", "api_server": kube.url,
        "token_file": str(token_file), "interval_s": 0.1,
    }}})
    gw = await gateway_factory(config, wait=False)
    await eventually(lambda: any(r.healthy and r.num_gpu_blocks for r in gw.gateway.registry),
                     timeout_s=4, what="the InferencePool's pod healthy")
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=SIM_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        )
    assert raw.headers["x-kvgate-replica"] == "vllm-0"
    assert raw.parse().usage.completion_tokens == 4
    kube.pods = []  # the pod went away: the pool is empty, and says so
    await eventually(lambda: not any(not r.draining for r in gw.gateway.registry),
                     timeout_s=4, what="the pod's replica gone")
