"""deploy/k8s/gateway-api: kvgate as the endpoint picker of a Gateway API inference gateway.
The core kinds are valid against the Kubernetes schemas and the InferencePool and HTTPRoute
against their v1 fields, offline; and the manifests agree with each other and with the code:
the picker's port, the pool's pods and port, the route's backend, the health service."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvgate.config import parse_config

BASE = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAY = BASE / "gateway-api"
KUBERNETES_VERSION = "1.30.0"

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253}
_PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
_META = {"type": "object", "required": ["name"]}
# inference.networking.k8s.io/v1 InferencePool, as the Gateway API Inference Extension's v1
# API defines its spec.
INFERENCE_POOL = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": _META,
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False, "required": ["matchLabels"],
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1, "maxProperties": 64,
                        "additionalProperties": {"type": "string", "maxLength": 63},
                    }},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string", "default": "Service"},
                        "name": _NAME,
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
# gateway.networking.k8s.io/v1 HTTPRoute: the fields this overlay uses.
HTTP_ROUTE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": _META,
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["parentRefs", "rules"],
            "properties": {
                "parentRefs": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["name"], "properties": {"name": _NAME}}},
                "rules": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "matches": {"type": "array", "items": {"type": "object", "properties": {
                            "path": {"type": "object", "required": ["type", "value"], "properties": {
                                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                "value": {"type": "string"}}}}}},
                        "backendRefs": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["name"], "additionalProperties": False,
                            "properties": {"group": {"type": "string"}, "kind": {"type": "string"},
                                           "name": _NAME, "port": {"type": "integer"},
                                           "weight": {"type": "integer"}}}},
                        "timeouts": {"type": "object", "additionalProperties": False, "properties": {
                            "request": {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"},
                            "backendRequest": {"type": "string"}}},
                    },
                }},
            },
        },
    },
}
CRDS = {"InferencePool": INFERENCE_POOL, "HTTPRoute": HTTP_ROUTE}


def docs(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(directory.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def one(kind: str, name: str, directory: Path = OVERLAY) -> dict[str, Any]:
    (doc,) = [d for d in docs(directory) if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def picker() -> dict[str, Any]:
    return one("Deployment", "kvgate-epp")["spec"]["template"]["spec"]["containers"][0]


def picker_config() -> Any:
    text = one("ConfigMap", "kvgate-epp-config")["data"]["kvgate.yaml"]
    return parse_config(yaml.safe_load(text), env={"REDIS_URL": "redis://redis:6379/0"})


@pytest.mark.parametrize("doc", docs(OVERLAY), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid_offline(doc):
    schema = CRDS.get(doc["kind"])
    if schema is None:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    else:
        jsonschema.validate(doc, schema)


def test_the_crd_schemas_refuse_what_the_api_refuses():
    pool = one("InferencePool", "vllm")
    broken = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {
        **pool["spec"]["endpointPickerRef"], "failureMode": "Sometimes"}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, INFERENCE_POOL)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**pool, "spec": {**pool["spec"], "targetPorts": []}}, INFERENCE_POOL)


def test_the_overlay_is_the_base_plus_every_manifest_here():
    listed = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())["resources"]
    assert "../" in listed
    assert set(listed) - {"../"} == {p.name for p in OVERLAY.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_pool_names_the_picker_on_the_port_kvgate_listens_on():
    ref = one("InferencePool", "vllm")["spec"]["endpointPickerRef"]
    service = one("Service", "kvgate-epp")
    assert ref["kind"] == "Service" and ref["name"] == service["metadata"]["name"]
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc"]
    assert ref["port"]["number"] == grpc["port"]
    ports = {p["name"]: p["containerPort"] for p in picker()["ports"]}
    assert grpc["targetPort"] in ports
    config = picker_config()
    assert config.server.epp.port == ports[grpc["targetPort"]] and config.server.epp.host == "0.0.0.0"
    assert config.server.port == ports["http"]
    assert service["spec"]["selector"].items() <= one(
        "Deployment", "kvgate-epp")["spec"]["template"]["metadata"]["labels"].items()


def test_the_pool_is_the_pods_kvgate_discovers_and_the_route_goes_to_it():
    pool = one("InferencePool", "vllm")
    vllm = one("Deployment", "vllm", BASE)["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= vllm["metadata"]["labels"].items()
    (target,) = pool["spec"]["targetPorts"]
    http = next(p for p in vllm["spec"]["containers"][0]["ports"] if p["name"] == "http")
    assert target["number"] == http["containerPort"]
    # the picker reads that very pool, in its own namespace, as its service account may
    (kvgate_pool,) = picker_config().pools.values()
    assert kvgate_pool.dns is None and kvgate_pool.inference_pool is not None
    assert kvgate_pool.inference_pool.name == pool["metadata"]["name"]
    assert kvgate_pool.inference_pool.namespace is None and kvgate_pool.replicas == []
    spec = one("Deployment", "kvgate-epp")["spec"]["template"]["spec"]
    account = one("ServiceAccount", spec["serviceAccountName"])["metadata"]["name"]
    binding = one("RoleBinding", "kvgate-epp")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    rules = one("Role", binding["roleRef"]["name"])["rules"]
    allowed = {(group, resource, verb) for r in rules for group in r["apiGroups"]
               for resource in r["resources"] for verb in r["verbs"]}  # fmt: skip
    group = pool["apiVersion"].split("/")[0]
    assert allowed == {(group, "inferencepools", "get"), ("", "pods", "list"),
                       ("inference.networking.x-k8s.io", "inferencepools", "get")}  # fmt: skip
    (rule,) = one("HTTPRoute", "vllm")["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                       "name": "vllm"}


def test_only_the_gateway_reaches_the_pickers_grpc_port():
    policy = one("NetworkPolicy", "kvgate-epp")["spec"]
    pods = one("Deployment", "kvgate-epp")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pods.items()
    grpc_rule = next(r for r in policy["ingress"] if "from" in r)
    assert [p["port"] for p in grpc_rule["ports"]] == [picker_config().server.epp.port]
    gateway = one("HTTPRoute", "vllm")["spec"]["parentRefs"][0]["name"]
    (source,) = grpc_rule["from"]
    assert source["podSelector"]["matchLabels"] == {
        "gateway.networking.k8s.io/gateway-name": gateway}
    others = [r for r in policy["ingress"] if "from" not in r]
    assert [p["port"] for r in others for p in r["ports"]] == [picker_config().server.port]


def test_the_picker_is_probed_where_kvgate_answers_and_drains_before_its_kill():
    container = picker()
    # alive, not ready (no restart for a fleet that is down), and over HTTP: the gRPC port
    # serves TLS, which a kubelet's gRPC probe cannot speak
    assert picker_config().server.epp.tls.enabled
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    spec = one("Deployment", "kvgate-epp")["spec"]["template"]["spec"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert spec["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + math.ceil(
        picker_config().server.drain_s)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["REDIS_URL"] == "redis://redis:6379/0"  # the proxy's Redis: the same books
