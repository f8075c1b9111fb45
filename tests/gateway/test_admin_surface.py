"""The admin surface: /admin/* needs the admin token whenever clients are identified by key,
is locked (never open) when no token is configured, and can move with /metrics to a listener of
its own."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvgate.api.admin import start_admin_listener
from tests.plugins.gateway import RunningGateway, StubUpstream, gateway_config, openai_error

ADMIN_TOKEN = "admin-token-0123456789"
TENANT_KEY = "sk-tenant-a"
GatewayFactory = Callable[..., Awaitable[RunningGateway]]
StubFactory = Callable[..., Awaitable[StubUpstream]]


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def keyed(**admin: Any) -> dict[str, Any]:
    """Sections for a kvgate whose clients are identified by API key."""
    return {
        "auth": {"mode": "api_key"},
        "tenants": [{"name": "a", "api_key_sha256": [sha(TENANT_KEY)]}],
        "server": {"admin": admin},
    }


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def call(
    http: aiohttp.ClientSession, method: str, url: str, token: str | None = None
) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.request(method, url, headers=headers) as response:
        return response.status, await response.read()


async def test_with_api_keys_the_admin_api_is_locked_until_a_token_is_configured(
    stub_factory: StubFactory, gateway_factory: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], **keyed()))
    replica = next(iter(gw.gateway.registry))
    for method, path in [("GET", "/admin/replicas"), ("POST", f"/admin/replicas/{replica.id}/drain")]:
        status, body = await call(http, method, f"{gw.url}{path}", TENANT_KEY)
        assert status == 403, body
        assert openai_error(body)["code"] == "admin_locked"
    assert not replica.draining


async def test_with_a_token_only_its_bearer_may_drain_a_replica(
    stub_factory: StubFactory, gateway_factory: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], **keyed(token_sha256=sha(ADMIN_TOKEN))))
    replica = next(iter(gw.gateway.registry))
    drain = f"{gw.url}/admin/replicas/{replica.id}/drain"
    for token in (None, "wrong", TENANT_KEY):  # a tenant's own key is not the admin token
        status, body = await call(http, "POST", drain, token)
        assert status == 401, body
        assert openai_error(body)["type"] == "authentication_error"
        assert not replica.draining
    status, _ = await call(http, "POST", drain, ADMIN_TOKEN)
    assert status == 200 and replica.draining
    status, _ = await call(http, "GET", f"{gw.url}/admin/replicas", ADMIN_TOKEN)
    assert status == 200


async def test_without_auth_the_admin_api_stays_open_unless_a_token_is_required(
    stub_factory: StubFactory, gateway_factory: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    stub = await stub_factory()
    open_gw = await gateway_factory(gateway_config([stub.url]))
    assert (await call(http, "GET", f"{open_gw.url}/admin/replicas"))[0] == 200
    closed = await gateway_factory(gateway_config([stub.url], server={"admin": {
        "require_token": True, "token_sha256": sha(ADMIN_TOKEN)}}))
    assert (await call(http, "GET", f"{closed.url}/admin/replicas"))[0] == 401
    assert (await call(http, "GET", f"{closed.url}/admin/replicas", ADMIN_TOKEN))[0] == 200


async def test_a_separate_admin_listener_takes_admin_and_metrics_off_the_api_port(
    stub_factory: StubFactory, gateway_factory: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    stub = await stub_factory()
    config = gateway_config([stub.url], **keyed(token_sha256=sha(ADMIN_TOKEN), port=0))
    gw = await gateway_factory(config)
    admin = await start_admin_listener(gw.gateway, config)
    assert admin is not None
    try:
        admin_url = f"http://127.0.0.1:{admin.addresses[0][1]}"
        for path in ("/metrics", "/admin/replicas"):
            status, body = await call(http, "GET", f"{gw.url}{path}", ADMIN_TOKEN)
            assert status == 404, (path, body)
            openai_error(body)
        status, body = await call(http, "GET", f"{admin_url}/metrics")
        assert status == 200 and b"kvgate_requests_total" in body
        assert (await call(http, "GET", f"{admin_url}/admin/replicas"))[0] == 401
        assert (await call(http, "GET", f"{admin_url}/admin/replicas", ADMIN_TOKEN))[0] == 200
        assert (await call(http, "GET", f"{gw.url}/health"))[0] == 200  # probes stay on the API
    finally:
        await admin.cleanup()
