"""Replicas from a Gateway API Inference Extension InferencePool, read through the Kubernetes
API: the pool's selector and target ports, then the pods the selector matches in its
namespace. Each ready pod (its Ready condition true, an IP, not being deleted) is a replica
per target port, named after the pod (`pod:port` where the pool has several ports, as the
Inference Extension's own picker counts each port as an endpoint). A pod that stops being
ready is drained, then forgotten (`Registry.found`, as for DNS). A round that fails (the API
down, the pool gone, a 403 for missing RBAC) keeps the last answer and says why.

Both versions of the resource are read: `inference.networking.k8s.io/v1` (`selector.
matchLabels`, `targetPorts[].number`) and `inference.networking.x-k8s.io/v1alpha2`
(`selector` as a map, `targetPortNumber`), the first found.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from kvgate.config import CurrentConfig, InferencePoolConfig, PoolConfig, ReplicaConfig
from kvgate.config.fleet import SERVICE_ACCOUNT
from kvgate.fleet.replicas import Registry, find
from kvgate.intervals import pause

log = logging.getLogger(__name__)

# The resource's API groups and versions, the current one first.
VERSIONS = ("inference.networking.k8s.io/v1", "inference.networking.x-k8s.io/v1alpha2")
TIMEOUT_S = 10.0


class KubeError(Exception):
    """The Kubernetes API did not answer as asked: its status (0: not an HTTP answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What kvgate reads of an InferencePool: which pods, on which ports."""

    selector: dict[str, str]
    ports: tuple[int, ...]


def pool_spec(resource: Mapping[str, Any]) -> PoolSpec:
    """The selector and target ports of an InferencePool of either version."""
    spec = resource.get("spec") or {}
    selector = spec.get("selector") or {}
    labels = (selector.get("matchLabels") or {}) if "matchLabels" in selector else selector
    ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or [])
    if not ports and spec.get("targetPortNumber"):
        ports = (int(spec["targetPortNumber"]),)
    if not labels or not ports:
        raise KubeError("the InferencePool has no selector labels or no target port")
    return PoolSpec({str(k): str(v) for k, v in labels.items()}, ports)


def ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])  # fmt: skip


def replica_configs(
    pods: Mapping[str, Any], spec: PoolSpec, scheme: str
) -> list[ReplicaConfig]:
    """One replica per ready pod and target port."""
    out = []
    for pod in sorted(pods.get("items") or [], key=lambda p: p["metadata"]["name"]):
        if not ready(pod):
            continue
        name, address = pod["metadata"]["name"], pod["status"]["podIP"]
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        for port in spec.ports:
            out.append(ReplicaConfig(
                url=f"{scheme}://{host}:{port}",
                name=name if len(spec.ports) == 1 else f"{name}:{port}",
            ))
    return out


class KubeApi:
    """GETs against the Kubernetes API: the cluster's own by default, with the pod's service
    account token (read afresh each time: the kubelet rotates it) and CA."""

    def __init__(self, session: aiohttp.ClientSession, config: InferencePoolConfig) -> None:
        self.session = session
        self.config = config
        self.server = config.api_server or in_cluster_server()
        self._ssl: ssl.SSLContext | None = None

    async def get(self, path: str, **params: str) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        token = await asyncio.to_thread(read_if_there, self.config.token_file)
        if token:
            headers["Authorization"] = f"Bearer {token.strip()}"
        if self._ssl is None and self.server.startswith("https"):
            self._ssl = await asyncio.to_thread(ssl_context, self.config.ca_file)
        async with self.session.get(
            self.server.rstrip("/") + path, params=params, headers=headers,
            ssl=self._ssl if self._ssl is not None else True,
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
        ) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                raise KubeError(f"GET {path}: {resp.status} {text}", resp.status)
            body: dict[str, Any] = await resp.json()
            return body

    async def pool(self, namespace: str, name: str) -> PoolSpec:
        """The InferencePool, of the first version the API serves it under."""
        missing = []
        for version in VERSIONS:
            path = f"/apis/{version}/namespaces/{quote(namespace)}/inferencepools/{quote(name)}"
            try:
                return pool_spec(await self.get(path))
            except KubeError as exc:
                if exc.status != 404:
                    raise
                missing.append(version)
        raise KubeError(f"no InferencePool {namespace}/{name} ({', '.join(missing)}: 404)")

    async def replicas(self, namespace: str) -> list[ReplicaConfig]:
        spec = await self.pool(namespace, self.config.name)
        selector = ",".join(f"{k}={v}" for k, v in sorted(spec.selector.items()))
        pods = await self.get(f"/api/v1/namespaces/{quote(namespace)}/pods",
                              labelSelector=selector)  # fmt: skip
        return replica_configs(pods, spec, self.config.scheme)


def in_cluster_server() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
        "KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise KubeError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): set "
                        "inference_pool.api_server")
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}"


def read_if_there(path: str | None) -> str | None:
    if path is None or not Path(path).is_file():
        return None
    return Path(path).read_text()


def ssl_context(ca_file: str | None) -> ssl.SSLContext:
    if ca_file is not None and Path(ca_file).is_file():
        return ssl.create_default_context(cafile=ca_file)
    return ssl.create_default_context()


def own_namespace() -> str:
    """The pod's namespace: its service account's, else POD_NAMESPACE, else `default`."""
    found = read_if_there(f"{SERVICE_ACCOUNT}/namespace")
    return (found or os.environ.get("POD_NAMESPACE") or "default").strip()


Reader = Callable[[str, InferencePoolConfig], Awaitable[list[ReplicaConfig]]]


async def read_pools(registry: Registry, pools: Mapping[str, PoolConfig], read: Reader) -> None:
    """One round: every pool fed by an InferencePool, read at once."""
    named = {name: p.inference_pool for name, p in pools.items() if p.inference_pool is not None}
    await find(registry, {pool: read(pool, source) for pool, source in named.items()},
               {pool: f"InferencePool {source.name}" for pool, source in named.items()})  # fmt: skip


async def inference_pools_loop(registry: Registry, current: CurrentConfig) -> None:
    """Read every InferencePool-fed pool of the config in force each interval (the shortest
    of theirs) until cancelled."""
    namespace = await asyncio.to_thread(own_namespace)
    apis: dict[str, KubeApi] = {}  # per pool, while its config holds
    async with aiohttp.ClientSession() as session:

        async def read(pool: str, source: InferencePoolConfig) -> list[ReplicaConfig]:
            api = apis.get(pool)
            if api is None or api.config != source:
                api = apis[pool] = KubeApi(session, source)
            return await api.replicas(source.namespace or namespace)

        while True:
            await read_pools(registry, current().pools, read)
            await pause(lambda: interval_s(current().pools))


def interval_s(pools: Mapping[str, PoolConfig]) -> float:
    return min((p.inference_pool.interval_s for p in pools.values()
                if p.inference_pool is not None), default=10.0)  # fmt: skip
