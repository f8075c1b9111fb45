"""Who is asking: API keys (by their SHA-256), the anonymous tenant, the trusted tenant header,
and the per-tenant limits that refuse a request before it reaches a replica.

Each tenant has its own tokens_per_minute, so the `x-ratelimit-limit-tokens` header on an
answer says which tenant kvgate took the request for.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.plugins.gateway import gateway_config, openai_error
from tests.tenants.support import MODEL, chat, digest, post

TENANTS: list[dict[str, Any]] = [
    {"name": "team-a", "api_key_sha256": [digest("key-a")], "tokens_per_minute": 100_000},
    {"name": "team-b", "api_key_sha256": [digest("key-b"), digest("key-b2")],
     "tokens_per_minute": 200_000},
    {"name": "anon", "tokens_per_minute": 50_000},
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_each_api_key_identifies_its_tenant_and_is_not_forwarded(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(
        gateway_config([stub.url], auth={"mode": "api_key"}, tenants=TENANTS)
    )
    async with aiohttp.ClientSession() as s:
        a = await post(s, gw.url, chat(), bearer("key-a"))
        b = await post(s, gw.url, chat(), bearer("key-b2"))
        lower = await post(s, gw.url, chat(), {"Authorization": "bearer key-b"})
        spoof = await post(s, gw.url, chat(), {"X-Tenant-Id": "team-b", **bearer("key-a")})
    assert (a.status, b.status, lower.status, spoof.status) == (200, 200, 200, 200)
    assert a.headers["x-ratelimit-limit-tokens"] == "100000"
    assert b.headers["x-ratelimit-limit-tokens"] == "200000"
    assert lower.headers["x-ratelimit-limit-tokens"] == "200000"
    assert spoof.headers["x-ratelimit-limit-tokens"] == "100000"  # api_key mode ignores it
    assert all("authorization" not in seen for seen in stub.headers_seen)


async def test_a_missing_or_unknown_api_key_gets_401_and_reaches_no_replica(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(
        gateway_config([stub.url], auth={"mode": "api_key"}, tenants=TENANTS)
    )
    async with aiohttp.ClientSession() as s:
        refused = [
            await post(s, gw.url, chat()),
            await post(s, gw.url, chat(), bearer("key-c")),
            await post(s, gw.url, chat(), bearer("")),
            await post(s, gw.url, chat(), {"Authorization": "Basic a2V5LWE="}),
            await post(s, gw.url, chat(), {"Authorization": digest("key-a")}),
        ]
    for reply in refused:
        assert reply.status == 401, reply
        error = openai_error(reply.body)
        assert error["type"] == "authentication_error"
        assert error["code"] == "invalid_api_key"
    assert "missing API key" in openai_error(refused[0].body)["message"]
    assert stub.received == []


async def test_requests_without_a_key_belong_to_the_anonymous_tenant_when_one_is_configured(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config(
        [stub.url], auth={"mode": "api_key", "anonymous_tenant": "anon"}, tenants=TENANTS
    ))
    async with aiohttp.ClientSession() as s:
        anonymous = await post(s, gw.url, chat())
        keyed = await post(s, gw.url, chat(), bearer("key-a"))
        wrong = await post(s, gw.url, chat(), bearer("key-c"))
    assert anonymous.status == 200
    assert anonymous.headers["x-ratelimit-limit-tokens"] == "50000"
    assert keyed.headers["x-ratelimit-limit-tokens"] == "100000"
    assert wrong.status == 401  # a wrong key is not silently anonymous


async def test_a_tenant_header_from_an_untrusted_address_is_refused(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    auth = {"mode": "trusted_header", "trusted_networks": ["10.0.0.0/8"]}
    gw = await gateway_factory(gateway_config([stub.url], auth=auth, tenants=TENANTS))
    async with aiohttp.ClientSession() as s:
        spoofed = await post(s, gw.url, chat(), {"X-Tenant-Id": "team-b"})
        spoofed_with_key = await post(
            s, gw.url, chat(), {"X-Tenant-Id": "team-b", **bearer("key-a")}
        )
        keyed = await post(s, gw.url, chat(), bearer("key-a"))
    for reply in (spoofed, spoofed_with_key):
        assert reply.status == 401, reply
        error = openai_error(reply.body)
        assert error["type"] == "authentication_error"
        assert "trusted networks" in error["message"]
    assert len(stub.received) == 1  # only the request that identified itself by key
    assert keyed.status == 200
    assert keyed.headers["x-ratelimit-limit-tokens"] == "100000"


async def test_a_tenant_header_from_a_trusted_network_names_the_tenant_and_stays_private(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    auth = {"mode": "trusted_header", "trusted_networks": ["127.0.0.1/32"]}
    gw = await gateway_factory(gateway_config([stub.url], auth=auth, tenants=TENANTS))
    async with aiohttp.ClientSession() as s:
        named = await post(s, gw.url, chat(), {"X-Tenant-Id": "team-b"})
        unknown = await post(s, gw.url, chat(), {"X-Tenant-Id": "team-z"})
        nothing = await post(s, gw.url, chat())
    assert named.status == 200, named
    assert named.headers["x-ratelimit-limit-tokens"] == "200000"
    assert "x-tenant-id" not in stub.headers_seen[0]
    assert unknown.status == 401
    assert "team-z" in openai_error(unknown.body)["message"]
    assert nothing.status == 401
    assert len(stub.received) == 1


async def test_a_model_outside_the_tenants_list_is_forbidden(stub_factory, gateway_factory):
    stub = await stub_factory()
    tenants = [{"name": "narrow", "api_key_sha256": [digest("k")], "models": ["other-model"]},
               {"name": "wide", "api_key_sha256": [digest("w")], "models": [MODEL]}]
    gw = await gateway_factory(
        gateway_config([stub.url], auth={"mode": "api_key"}, tenants=tenants)
    )
    async with aiohttp.ClientSession() as s:
        narrow = await post(s, gw.url, chat(), bearer("k"))
        wide = await post(s, gw.url, chat(), bearer("w"))
    assert narrow.status == 403, narrow
    error = openai_error(narrow.body)
    assert error["type"] == "permission_error"
    assert error["code"] == "model_not_allowed"
    assert MODEL in error["message"] and "narrow" in error["message"]
    assert wide.status == 200
    assert len(stub.received) == 1


async def test_max_tokens_above_the_tenants_cap_is_refused_and_an_omitted_one_is_capped(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    tenants = [{"name": "capped", "max_tokens_cap": 100}]
    gw = await gateway_factory(gateway_config(
        [stub.url], auth={"mode": "none", "anonymous_tenant": "capped"}, tenants=tenants
    ))
    async with aiohttp.ClientSession() as s:
        over = await post(s, gw.url, chat(max_tokens=101))
        at_cap = await post(s, gw.url, chat(max_tokens=100))
        omitted = await post(s, gw.url, {k: v for k, v in chat().items() if k != "max_tokens"})
    assert over.status == 400, over
    error = openai_error(over.body)
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "max_tokens_above_cap"
    assert error["param"] == "max_tokens"
    assert "101" in error["message"] and "cap of 100" in error["message"]
    assert (at_cap.status, omitted.status) == (200, 200)
    assert [body["max_tokens"] for body in stub.received] == [100, 100]


async def test_a_worst_case_above_the_tenants_context_limit_is_refused(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    tenants = [{"name": "short", "max_context_tokens": 60}]
    gw = await gateway_factory(gateway_config(
        [stub.url], auth={"mode": "none", "anonymous_tenant": "short"}, tenants=tenants
    ))
    async with aiohttp.ClientSession() as s:
        over = await post(s, gw.url, chat(max_tokens=55))  # ~9 prompt tokens + 55 > 60
        within = await post(s, gw.url, chat(max_tokens=40))
    assert over.status == 400, over
    error = openai_error(over.body)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"
    assert "at most 60 tokens" in error["message"] and "55 in the completion" in error["message"]
    assert within.status == 200
    assert [body["max_tokens"] for body in stub.received] == [40]
