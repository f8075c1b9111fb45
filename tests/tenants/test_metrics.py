"""Per-tenant metrics on /metrics: tokens by kind, refusals by reason, concurrent requests,
tokens left, and the state store's health."""

from __future__ import annotations

import aiohttp

from tests.plugins.gateway import gateway_config, wait_settled
from tests.plugins.waiting import eventually
from tests.tenants.support import chat, digest, metrics, post, sample


async def test_tenant_tokens_refusals_concurrency_and_store_health_are_exported(
    stub_factory, gateway_factory
):
    stub = await stub_factory(chunks=3)
    gw = await gateway_factory(gateway_config(
        [stub.url],
        auth={"mode": "api_key"},
        tenants=[{"name": "team", "api_key_sha256": [digest("k")], "tokens_per_minute": 60_000,
                  "requests_per_minute": 2, "max_concurrent": 5}],
    ))
    key = {"Authorization": "Bearer k"}
    async with aiohttp.ClientSession() as s:
        statuses = [(await post(s, gw.url, chat(max_tokens=100), key)).status for _ in range(3)]
        unknown = await post(s, gw.url, chat(), {"Authorization": "Bearer nope"})
        await wait_settled(gw)

        async def refunded_twice() -> bool:  # the second answer's settlement may still run
            samples = await metrics(s, gw.url)
            refunds = sample(samples, "kvgate_tenant_tokens_total", tenant="team", kind="refunded")
            completions = sample(
                samples, "kvgate_tenant_tokens_total", tenant="team", kind="completion"
            )
            return refunds is not None and completions == 6

        await eventually(refunded_twice, what="both requests settled")
        samples = await metrics(s, gw.url)
    assert statuses == [200, 200, 429]
    assert unknown.status == 401

    def tokens(kind: str) -> float | None:
        return sample(samples, "kvgate_tenant_tokens_total", tenant="team", kind=kind)

    assert tokens("prompt") == 2 * 10 and tokens("completion") == 2 * 3
    reserved, refunded = tokens("reserved"), tokens("refunded")
    assert reserved is not None and refunded is not None
    assert reserved >= 2 * 100 and reserved - refunded == 2 * 13  # charged what was used
    remaining = sample(samples, "kvgate_tenant_remaining_tokens", tenant="team")
    assert remaining is not None and 60_000 - 2 * 13 - reserved / 2 <= remaining <= 60_000
    assert sample(samples, "kvgate_tenant_concurrent_requests", tenant="team") == 0
    assert sample(samples, "kvgate_refusals_total",
                  pool="default", tenant="team", reason="rate_limited") == 1
    assert sample(samples, "kvgate_refusals_total",
                  pool="none", tenant="unknown", reason="unauthorized") == 1
    assert sample(samples, "kvgate_requests_total", model="stub-model", pool="default",
                  tenant="team", outcome="ok") == 2
    assert sample(samples, "kvgate_state_store_up", backend="memory") == 1
