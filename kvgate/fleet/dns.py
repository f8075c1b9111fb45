"""Replicas found by DNS: a pool's `dns.name` (a Kubernetes headless Service has one address
per ready pod) is resolved every `dns.interval_s`, and each address is a replica of the pool,
named `address:port`. An address that stops resolving is drained — its requests finish, it
takes no new ones — then forgotten (`Registry`). A failed resolution keeps the last answer:
a DNS blip must not empty a pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping

from kvgate.config import CurrentConfig, DnsConfig, PoolConfig, ReplicaConfig
from kvgate.fleet.replicas import Registry, find
from kvgate.intervals import pause

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[set[str]]]


async def resolve(name: str, port: int) -> set[str]:
    """Every address `name` resolves to (IPv4 and IPv6), by the system's resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return {str(info[4][0]) for info in infos}


def replica_configs(dns: DnsConfig, addresses: set[str]) -> list[ReplicaConfig]:
    out = []
    for address in sorted(addresses):
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        out.append(ReplicaConfig(url=f"{dns.scheme}://{host}:{dns.port}"))
    return out


async def resolve_pools(
    registry: Registry, pools: Mapping[str, PoolConfig], resolver: Resolver = resolve
) -> None:
    """One round: every pool with a DNS name, resolved at once."""
    named = {name: pool.dns for name, pool in pools.items() if pool.dns is not None}

    async def read(dns: DnsConfig) -> list[ReplicaConfig]:
        return replica_configs(dns, await resolver(dns.name, dns.port))

    await find(registry, {pool: read(dns) for pool, dns in named.items()},
               {pool: dns.name for pool, dns in named.items()})  # fmt: skip


async def dns_loop(
    registry: Registry, current: CurrentConfig, resolver: Resolver = resolve
) -> None:
    """Resolve every DNS-named pool of the config in force each interval (the shortest of
    theirs) until cancelled."""
    while True:
        await resolve_pools(registry, current().pools, resolver)
        await pause(lambda: interval_s(current().pools))


def interval_s(pools: Mapping[str, PoolConfig]) -> float:
    """How often the DNS-named pools are resolved: the shortest of their intervals."""
    return min((p.dns.interval_s for p in pools.values() if p.dns is not None), default=10.0)
