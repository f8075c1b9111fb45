"""The fleet's sections of the configuration: each pool, its replicas (listed, found by DNS
or read from an InferencePool) and their KV cache events. Part of `kvgate.config.schema`'s
tree, in the order of config/kvgate.yaml's `pools`."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from kvgate.config.base import PositiveFloat, PositiveInt, Section


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL")
    if "@" in parts.netloc:
        # a replica's id is its host:port, sent to clients (X-Kvgate-Replica), in metric labels
        # and in logs: credentials there would leak everywhere
        raise ValueError("a replica URL may not carry credentials; use api_key")
    return value.rstrip("/")


class KvEventsEndpoints(Section):
    """Where one replica publishes vLLM's KV cache events (its `--kv-events-config`
    `endpoint` and `replay_endpoint`, with the replica's address for `*`; a data-parallel
    rank k publishes at these ports + k, as vLLM offsets them)."""

    endpoint: str = Field(pattern=r"^tcp://[^:/]+:\d+$")
    replay_endpoint: str | None = Field(None, pattern=r"^tcp://[^:/]+:\d+$")


class KvEventsConfig(Section):
    """Subscribe to each replica's KV cache events (vLLM started with `--kv-events-config
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558", "topic": "kv"}'`): an index of the blocks each replica
    holds. A replica's endpoints are its URL's host at `port` and `replay_port`, unless the
    replica names its own; each of its data-parallel ranks (the engines its /metrics names)
    at those ports + the rank."""

    port: int = Field(5557, ge=1, le=65535)
    replay_port: int | None = Field(5558, ge=1, le=65535)
    topic: str = ""  # vLLM's default; "" hears every topic
    # A replica that has published nothing for this long while its prompts missed its cache
    # (tokens it computed and must have stored), and one that fails its health check, lose
    # their index (its cache may be gone with them).
    silent_after_s: PositiveFloat = 30.0
    replay_timeout_s: PositiveFloat = 2.0
    # How the replicas hash blocks (vLLM's --prefix-caching-hash-algo, and PYTHONHASHSEED
    # where it is set; vLLM's own seed otherwise): kvgate computes the same hashes, so that a
    # block stored under a prefix cached before it subscribed still matches. Checked against
    # each replica's first root block before it is relied on; null: by content alone.
    block_hash: Literal["sha256", "sha256_cbor"] | None = "sha256"
    hash_seed: str = "vllm-none-hash"


class ReplicaConfig(Section):
    url: str
    name: str | None = None
    api_key: SecretStr | None = None
    # Overrides for what discovery reads from the replica's /metrics and /v1/models.
    num_gpu_blocks: PositiveInt | None = None
    block_size: PositiveInt | None = None
    max_model_len: PositiveInt | None = None
    # Take no new requests (in-flight ones finish; sessions bound here are rebound), as
    # `POST /admin/replicas/{id}/drain` does at run time.
    drain: bool = False
    # Where it publishes KV cache events, if not at its pool's `kv_events` ports.
    kv_events: KvEventsEndpoints | None = None

    _check_url = field_validator("url")(classmethod(lambda cls, v: _http_url(v)))

    @property
    def id(self) -> str:
        return self.name or urlsplit(self.url).netloc


class DnsConfig(Section):
    """Replicas found by resolving a name (a Kubernetes headless Service lists one address per
    ready pod), re-resolved every `interval_s`; an address that disappears is drained."""

    name: str = Field(min_length=1)
    port: int = Field(8000, ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    interval_s: PositiveFloat = 10.0


# Where a pod finds its service account: the API's token (rotated by the kubelet, so read
# afresh each round), its CA, and the pod's namespace.
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class InferencePoolConfig(Section):
    """Replicas from a Gateway API Inference Extension InferencePool (`inference.networking.
    k8s.io/v1`, or `inference.networking.x-k8s.io/v1alpha2`): the ready pods its selector
    matches, one replica per pod and target port, read through the Kubernetes API every
    `interval_s`; a pod that stops being ready is drained."""

    name: str = Field(min_length=1)
    namespace: str | None = None  # None: kvgate's own (its service account's)
    # None: the cluster's own API (KUBERNETES_SERVICE_HOST and _PORT), as a pod reaches it;
    # else a URL (`kubectl proxy`'s http://127.0.0.1:8001, say)
    api_server: str | None = None
    token_file: str | None = f"{SERVICE_ACCOUNT}/token"  # sent as a bearer token if it exists
    ca_file: str | None = f"{SERVICE_ACCOUNT}/ca.crt"  # trusted for https if it exists
    scheme: Literal["http", "https"] = "http"
    interval_s: PositiveFloat = 5.0


class PoolConfig(Section):
    replicas: list[ReplicaConfig] = []
    dns: DnsConfig | None = None
    inference_pool: InferencePoolConfig | None = None
    # A request goes to the pool with the highest threshold its worst case reaches.
    min_worst_case_tokens: int = Field(0, ge=0)
    # Pool to try when this one has no healthy replica with capacity for the request.
    overflow_to: str | None = None
    # Its replicas' KV cache events (None: not subscribed).
    kv_events: KvEventsConfig | None = None
    # Its replicas' vLLM --scheduling-policy. priority: kvgate sends each request's class as
    # vLLM's `priority` (critical first, then standard, then sheddable; a client's own value
    # orders its requests within their class), so the critical class goes first in vLLM's
    # own queue and is the last vLLM preempts. fcfs: vLLM refuses any `priority`, so kvgate
    # refuses a client's non-zero one itself (400). null: unknown; kvgate adds none and
    # forwards a client's own.
    scheduling_policy: Literal["fcfs", "priority"] | None = None

    @model_validator(mode="after")
    def _has_replicas(self) -> PoolConfig:
        if self.dns is not None and self.inference_pool is not None:
            raise ValueError("a pool finds its replicas by dns or from an inference_pool, "
                             "not both")
        if not self.replicas and self.found_by is None:
            raise ValueError("a pool needs replicas, a dns name or an inference_pool")
        return self

    @property
    def found_by(self) -> DnsConfig | InferencePoolConfig | None:
        """Where replicas beyond those listed come from, if anywhere."""
        return self.dns or self.inference_pool
