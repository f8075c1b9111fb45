"""The Kubernetes manifests (deploy/k8s) are valid against the Kubernetes schemas, offline, and
agree with the code: ports, probe paths, the config keys and the drain time."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from aiohttp import web

from kvgate.api.routes import add_routes
from kvgate.config import parse_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
CRDS = {"monitoring.coreos.com/v1": {"ServiceMonitor"}}  # not in the core schemas


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(kind: str, name: str) -> dict[str, Any]:
    return one(kind, name)["spec"]["template"]["spec"]["containers"][0]


def kvgate_config() -> Any:
    text = one("ConfigMap", "kvgate-config")["data"]["kvgate.yaml"]
    return parse_config(yaml.safe_load(text), env={"REDIS_URL": "redis://redis:6379/0"})


@pytest.mark.parametrize(
    "doc", [d for d in manifests() if d["kind"] not in CRDS.get(d["apiVersion"], ())],
    ids=lambda d: f"{d['kind']}/{d['metadata']['name']}",
)
def test_each_manifest_is_valid_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_config_map_is_a_valid_kvgate_config_on_the_container_port():
    config = kvgate_config()
    kvgate = container("Deployment", "kvgate")
    (port,) = kvgate["ports"]
    assert config.server.port == port["containerPort"]
    service = one("Service", "kvgate")
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert kvgate["args"][kvgate["args"].index("--config") + 1] == "/etc/kvgate/kvgate.yaml"
    mount = next(m for m in kvgate["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/etc/kvgate"


def test_probes_hit_endpoints_kvgate_serves():
    app = web.Application()
    add_routes(app)
    served = {r.resource.canonical for r in app.router.routes() if r.method == "GET"}
    kvgate = container("Deployment", "kvgate")
    assert kvgate["readinessProbe"]["httpGet"]["path"] == "/ready" in served
    assert kvgate["livenessProbe"]["httpGet"]["path"] == "/health" in served
    monitor = one("ServiceMonitor", "kvgate")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics" in served


def test_shutdown_gives_pre_stop_and_the_whole_drain_time_before_the_kill():
    spec = one("Deployment", "kvgate")["spec"]
    assert spec["replicas"] >= 2
    pre_stop = spec["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = int(pre_stop[1]) + math.ceil(kvgate_config().server.drain_s)
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] >= needed


def test_selectors_match_the_pods_they_mean():
    pods = one("Deployment", "kvgate")["spec"]["template"]["metadata"]["labels"]
    for selector in (
        one("PodDisruptionBudget", "kvgate")["spec"]["selector"]["matchLabels"],
        one("Service", "kvgate")["spec"]["selector"],
    ):
        assert selector.items() <= pods.items()
    for name in ("kvgate", "vllm"):
        monitor = one("ServiceMonitor", name)["spec"]
        service = one("Service", name)
        assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_kvgate_reaches_every_vllm_pod_and_the_redis_service_by_name():
    vllm = one("Deployment", "vllm")["spec"]
    headless = one("Service", "vllm")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= vllm["template"]["metadata"]["labels"].items()
    port = headless["spec"]["ports"][0]["port"]
    (pool,) = kvgate_config().pools.values()
    assert pool.dns is not None and not pool.replicas
    namespace = one("Namespace", "kvgate")["metadata"]["name"]
    assert pool.dns.name == f"vllm.{namespace}.svc.cluster.local"
    assert pool.dns.port == port
    env = {e["name"]: e["value"] for e in container("Deployment", "kvgate")["env"]}
    redis = one("Service", "redis")["spec"]["ports"][0]["port"]
    assert env["REDIS_URL"] == f"redis://redis:{redis}/0"


def test_kvgate_subscribes_to_the_kv_events_each_vllm_pod_publishes():
    import json

    args = container("Deployment", "vllm")["args"]
    flag = json.loads(args[args.index("--kv-events-config") + 1])
    (pool,) = kvgate_config().pools.values()
    assert pool.kv_events is not None and flag["enable_kv_cache_events"] is True
    assert flag["publisher"] == "zmq" and flag["topic"] == pool.kv_events.topic
    assert flag["endpoint"] == f"tcp://*:{pool.kv_events.port}"
    assert flag["replay_endpoint"] == f"tcp://*:{pool.kv_events.replay_port}"
    ports = {p["containerPort"] for p in container("Deployment", "vllm")["ports"]}
    assert {pool.kv_events.port, pool.kv_events.replay_port} <= ports
