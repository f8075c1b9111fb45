"""Replicas found by DNS: each address a replica, one that stops resolving drained until its
requests finish, a failed resolution keeping the last answer; and a pool found this way
serving through kvgate."""

from __future__ import annotations

import aiohttp

from kvgate.config import DnsConfig, PoolConfig, ReplicaConfig
from kvgate.fleet.dns import replica_configs, resolve, resolve_pools
from kvgate.fleet.replicas import Registry
from tests.plugins.gateway import gateway_config
from tests.plugins.waiting import eventually

DNS = DnsConfig(name="vllm.ns.svc", port=8000)


def pools(**extra: object) -> dict[str, PoolConfig]:
    return {"gpu": PoolConfig(dns=DNS, **extra)}  # type: ignore[arg-type]


def answering(*answers: set[str] | Exception):
    replies = list(answers)

    async def resolver(name: str, port: int) -> set[str]:
        assert (name, port) == ("vllm.ns.svc", 8000)
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    return resolver


async def test_every_address_is_a_replica_and_one_that_disappears_drains_until_idle():
    registry = Registry()
    registry.sync({"gpu": []}, found={"gpu"})
    resolver = answering({"10.0.0.1", "10.0.0.2"}, {"10.0.0.2"}, {"10.0.0.2"})
    await resolve_pools(registry, pools(), resolver)
    assert sorted(r.id for r in registry) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    leaving = registry.get("10.0.0.1:8000")
    assert leaving is not None and leaving.pool == "gpu"
    leaving.inflight["a-request"] = object()  # type: ignore[assignment]
    await resolve_pools(registry, pools(), resolver)
    assert registry.get("10.0.0.1:8000") is leaving and leaving.draining
    del leaving.inflight["a-request"]
    await resolve_pools(registry, pools(), resolver)
    assert [r.id for r in registry] == ["10.0.0.2:8000"]


async def test_a_failed_resolution_keeps_the_last_answer():
    registry = Registry()
    registry.sync({"gpu": []}, found={"gpu"})
    resolver = answering({"10.0.0.1"}, OSError("SERVFAIL"))
    await resolve_pools(registry, pools(), resolver)
    await resolve_pools(registry, pools(), resolver)
    assert [r.id for r in registry] == ["10.0.0.1:8000"]


async def test_listed_and_found_replicas_live_side_by_side_and_a_reload_keeps_both():
    registry = Registry()
    listed = ReplicaConfig(url="http://static:8000", name="static")
    registry.sync({"gpu": [listed]}, found={"gpu"})
    await resolve_pools(registry, pools(replicas=[listed]), answering({"10.0.0.9"}))
    kept = registry.get("10.0.0.9:8000")
    registry.sync({"gpu": [listed]}, found={"gpu"})  # a reload: the found replica stays as it is
    assert registry.get("10.0.0.9:8000") is kept
    assert sorted(r.id for r in registry) == ["10.0.0.9:8000", "static"]


async def test_a_reload_that_removes_the_dns_name_drops_the_replicas_found_by_it():
    registry = Registry()
    listed = ReplicaConfig(url="http://static:8000", name="static")
    registry.sync({"gpu": [listed]}, found={"gpu"})
    await resolve_pools(registry, pools(replicas=[listed]), answering({"10.0.0.9"}))
    registry.sync({"gpu": [listed]}, found=set())
    assert [r.id for r in registry] == ["static"]


async def test_a_listed_replica_keeps_its_own_settings_when_dns_also_finds_it():
    registry = Registry()
    listed = ReplicaConfig(url="http://10.0.0.5:8000", api_key="k", num_gpu_blocks=77, drain=True)
    registry.sync({"gpu": [listed]}, found={"gpu"})
    await resolve_pools(registry, pools(replicas=[listed]), answering({"10.0.0.5"}))
    (replica,) = list(registry)
    assert (replica.api_key, replica.num_gpu_blocks, replica.draining) == ("k", 77, True)


def test_ipv6_addresses_become_bracketed_urls():
    (config,) = replica_configs(DNS, {"fd00::7"})
    assert config.url == "http://[fd00::7]:8000" and config.id == "[fd00::7]:8000"


async def test_the_system_resolver_finds_localhost():
    assert "127.0.0.1" in await resolve("localhost", 80)


async def test_a_pool_found_by_dns_serves_requests(sim_factory, gateway_factory):
    sim = await sim_factory(time_scale=0.01)
    port = int(sim.url.rsplit(":", 1)[1])
    config = gateway_config([], pools={"default": {"dns": {
        "name": "127.0.0.1", "port": port, "interval_s": 0.1}}})
    gw = await gateway_factory(config, wait=False)
    await eventually(lambda: any(r.healthy and r.num_gpu_blocks for r in gw.gateway.registry),
                     timeout_s=4, what="the replica found by DNS healthy")
    body = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http, \
            http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["X-Kvgate-Replica"] == f"127.0.0.1:{port}"
