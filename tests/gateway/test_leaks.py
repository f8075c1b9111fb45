"""Nothing leaks and nothing is raised from the client side: upstream credentials never reach
a client, a log or a metric; client input cannot shape a response header; a tenant cannot
raise its own limits, priority or pool through headers or body fields."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from kvgate.config import ConfigError, parse_config
from tests.plugins.gateway import RunningGateway, StubUpstream, gateway_config, openai_error

UPSTREAM_KEY = "sk-upstream-secret-9f8e7d"
GatewayFactory = Callable[..., Awaitable[RunningGateway]]
StubFactory = Callable[..., Awaitable[StubUpstream]]
CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def everything_a_client_sees(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> str:
    out = []
    for stream in (False, True):
        async with http.post(f"{url}/v1/chat/completions", json={**body, "stream": stream}) as r:
            out.append(f"{r.status} {dict(r.headers)} {(await r.read()).decode()}")
    return "\n".join(out)


async def test_the_upstream_api_key_never_reaches_a_client_a_log_or_a_metric(
    stub_factory: StubFactory, gateway_factory: GatewayFactory, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([], pools={"default": {"replicas": [
        {"url": stub.url, "api_key": UPSTREAM_KEY}]}}))
    seen = [await everything_a_client_sees(http, gw.url, CHAT)]
    assert stub.headers_seen[-1]["authorization"] == f"Bearer {UPSTREAM_KEY}"  # it was used
    for status in (401, 500):  # the replica refuses, or fails
        stub.status = status
        seen.append(await everything_a_client_sees(http, gw.url, CHAT))
    for path in ("/metrics", "/admin/replicas"):
        async with http.get(f"{gw.url}{path}") as r:
            seen.append((await r.read()).decode())
    seen.extend(record.getMessage() for record in caplog.records)
    assert UPSTREAM_KEY not in "\n".join(seen)


def test_a_replica_url_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"pools": {"default": {"replicas": [
            {"url": "http://user:hunter2@10.0.0.1:8000"}]}}})
    assert "pools.default.replicas[0].url" in str(caught.value)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("given", ["id-é", "ид-запроса", "a b", "x" * 129])
async def test_a_request_id_that_is_not_visible_ascii_is_replaced_not_echoed(
    stub_factory: StubFactory, gateway_factory: GatewayFactory, given: str
) -> None:
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    async with aiohttp.ClientSession() as http, http.post(
        f"{gw.url}/v1/chat/completions", data=orjson.dumps(CHAT),
        headers={"X-Request-Id": given.encode("utf-8").decode("latin-1")},
    ) as r:
        assert r.status == 200
        echoed = r.headers["X-Request-Id"]
    assert echoed.isascii() and echoed.isprintable() and " " not in echoed
    assert echoed != given
    assert stub.headers_seen[-1]["x-request-id"] == echoed


async def test_a_tenant_cannot_claim_another_tenants_limits_priority_or_pool(
    stub_factory: StubFactory, gateway_factory: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], auth={"mode": "api_key"}, tenants=[
        {"name": "small", "api_key_sha256": [sha("sk-small")], "max_tokens_cap": 10,
         "priority": "sheddable"},
        {"name": "big", "api_key_sha256": [sha("sk-big")], "priority": "critical"},
    ]))
    claims = {"Authorization": "Bearer sk-small", "X-Tenant-Id": "big",
              "X-Kvgate-Pool": "long", "X-Kvgate-Priority": "critical"}
    async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "max_tokens": 50},
                         headers=claims) as r:
        assert r.status == 400  # still 'small', whose cap is 10
        assert openai_error(await r.read())["code"] == "max_tokens_above_cap"
    async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "priority": -100},
                         headers=claims) as r:
        assert r.status == 400  # vLLM's own queue order is not the client's to set
        assert openai_error(await r.read())["param"] == "priority"
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=claims) as r:
        assert r.status == 200
    forwarded = stub.headers_seen[-1]
    assert "x-tenant-id" not in forwarded and "priority" not in stub.received[-1]
    assert forwarded.get("authorization") is None  # the tenant's key stays with kvgate
