"""`kvgate envoy-config FILE`: the Envoy configuration that puts Envoy in front of this
config's replicas with kvgate as its endpoint picker (server.epp), as YAML.

    kvgate envoy-config kvgate.yaml --listen 0.0.0.0:8081 > envoy.yaml && envoy -c envoy.yaml

For a standalone Envoy; a Gateway API gateway (Istio, kgateway, GKE, ...) writes its own from
the InferencePool (deploy/k8s/gateway-api). See docs/envoy.md.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from kvgate.config import Config, ConfigError, load_config
from kvgate.epp.envoy import bootstrap
from kvgate.fleet.replicas import Replica

BODY_MODES = {"streamed": "STREAMED", "none": "NONE", "full-duplex": "FULL_DUPLEX_STREAMED"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="kvgate's YAML config (server.epp.port set)")
    parser.add_argument("--listen", default="0.0.0.0:8081", metavar="HOST:PORT",
                        help="where Envoy serves the OpenAI API (0.0.0.0:8081)")
    parser.add_argument("--picker", metavar="HOST:PORT",
                        help="where Envoy reaches kvgate's picker (server.epp's address)")
    parser.add_argument("--admin", metavar="HOST:PORT", help="Envoy's admin listener (none)")
    parser.add_argument("--response-body", choices=list(BODY_MODES), default="streamed",
                        help="streamed: the answer's body through kvgate (exact charges); "
                             "none: only its headers and end (cheaper; charged by the "
                             "replica's decode clock); full-duplex: both bodies in full "
                             "duplex, as Istio, kgateway and GKE configure ext_proc (no "
                             "message timeout while a request queues)")
    parser.add_argument("--failure-mode-allow", action="store_true",
                        help="while kvgate is down, Envoy round-robins (default: it refuses)")


def message_timeout_s(config: Config) -> float:
    """How long Envoy must wait for the pick: the request may wait for its session's replica,
    then in the queue, before kvgate answers."""
    return config.routing.sessions.affinity_wait_s + config.admission.queue.max_wait_s + 5.0


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(f"{args.file}: invalid\n{exc}", file=sys.stderr)
        return 2
    epp = config.server.epp
    if epp.port is None and args.picker is None:
        print(f"{args.file}: set server.epp.port (or give --picker)", file=sys.stderr)
        return 2
    replicas, found_by_dns = [], []
    for name, pool in config.pools.items():
        if pool.dns is not None:
            found_by_dns.append(name)
        replicas += [Replica(r, name).address for r in pool.replicas]
    for name in found_by_dns:
        print(f"# pool {name} is found through DNS: give Envoy its endpoints (a STRICT_DNS "
              "cluster, or your gateway's EDS)", file=sys.stderr)
    if not replicas:
        print(f"{args.file}: no static replicas for Envoy's cluster", file=sys.stderr)
        return 2
    host = "127.0.0.1" if epp.host in ("0.0.0.0", "::") else epp.host
    tree = bootstrap(
        listen=args.listen, picker=args.picker or f"{host}:{epp.port}", replicas=replicas,
        admin=args.admin, failure_mode_allow=args.failure_mode_allow,
        response_body=BODY_MODES[args.response_body],
        message_timeout_s=message_timeout_s(config),
        max_body_bytes=config.server.max_body_bytes,
        total_s=config.timeouts.total_s, idle_s=config.timeouts.idle_s,
        picker_tls=epp.tls.enabled,
    )
    sys.stdout.write(yaml.safe_dump(tree, sort_keys=False))
    return 0
