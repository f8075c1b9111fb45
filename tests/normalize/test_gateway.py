"""Normalization on the request path: what is forwarded, what /metrics and /admin/prompts say."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvgate.app import build_app
from kvgate.exchange import EXCHANGE, Exchange
from tests.plugins import bodies, client
from tests.plugins.gateway import RunningGateway, gateway_config, serve_app
from tests.plugins.waiting import eventually

TENANTS = {
    "auth": {"mode": "trusted_header", "trusted_networks": ["127.0.0.1/32"]},
    "tenants": [{"name": "acme"}, {"name": "raw", "normalization": {"enabled": False}}],
}


def chat(system: str, question: str = "hi", **fields: Any) -> dict[str, Any]:
    return bodies.chat(question, system_prompt=system, **fields)


async def post(gw: RunningGateway, body: dict[str, Any], tenant: str | None = None) -> int:
    headers = {"X-Tenant-Id": tenant} if tenant else {}
    return (await client.post(f"{gw.url}/v1/chat/completions", body, headers=headers)).status


async def scrape(gw: RunningGateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


async def test_the_normalized_body_is_what_reaches_the_replica(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    tools = [{"function": {"name": "f"}, "type": "function"}]
    assert await post(gw, chat("Be brief.  \r\nBe kind.\u200b", tools=tools)) == 200
    forwarded = stub.received[0]
    assert forwarded["messages"][0]["content"] == "Be brief.\nBe kind."
    assert list(forwarded["tools"][0]) == ["function", "type"]


async def test_a_body_no_rule_changes_is_forwarded_as_sent(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    body = chat("Be brief.", extra_field={"b": 1, "a": 2})
    assert await post(gw, body) == 200
    assert orjson.dumps(stub.received[0]) == orjson.dumps(body)
    metrics = await scrape(gw)
    assert metrics[("kvgate_normalization_requests_total", (("result", "unchanged"),))] == 1


async def test_a_tenant_with_normalization_off_is_forwarded_as_sent(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], **TENANTS))
    await post(gw, chat("Be brief.  "), tenant="raw")
    await post(gw, chat("Be brief.  "), tenant="acme")
    assert [r["messages"][0]["content"] for r in stub.received] == ["Be brief.  ", "Be brief."]


async def test_edits_bytes_and_share_modified_are_counted(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    await post(gw, chat("Be brief.  \r\n"))
    await post(gw, chat("Be brief."))
    m = await scrape(gw)
    assert m[("kvgate_normalization_requests_total", (("result", "modified"),))] == 1
    assert m[("kvgate_normalization_requests_total", (("result", "unchanged"),))] == 1
    assert m[("kvgate_normalization_edits_total", (("rule", "trailing_whitespace"),))] == 1
    assert m[("kvgate_normalization_changed_bytes_total", (("rule", "line_endings"),))] == 1
    assert m[("kvgate_normalization_changed_tokens_total", (("rule", "trailing_whitespace"),))] == 1


async def test_a_system_prompt_edit_shows_in_the_next_scrape_of_metrics(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], **TENANTS))
    change = ("kvgate_system_prompt_changes_total", (("model", "stub-model"), ("tenant", "acme")))
    for _ in range(3):
        await post(gw, chat("You are the v1 assistant."), tenant="acme")
    assert (await scrape(gw)).get(change, 0) == 0
    await post(gw, chat("You are the v2 assistant."), tenant="acme")  # the deploy
    assert (await scrape(gw))[change] == 1
    await post(gw, chat("You are the v2 assistant."), tenant="acme")
    assert (await scrape(gw))[change] == 1  # a step, not a slope


async def test_fingerprint_gauges_name_the_busiest_prompts_and_count_per_tenant(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], **TENANTS))
    for system, n in [("A", 3), ("B", 1)]:
        for _ in range(n):
            await post(gw, chat(system), tenant="acme")
    deadline = time.monotonic() + 10
    while True:  # the gauges are refreshed once a second, off the request path
        m = await scrape(gw)
        busiest = sorted((v, k[1]) for k, v in m.items()
                         if k[0] == "kvgate_prompt_fingerprint_requests")
        if [v for v, _ in busiest] == [0, 1, 3]:
            break
        assert time.monotonic() < deadline, busiest
        await asyncio.sleep(0.05)
    assert busiest[0][1] == (("fingerprint", "other"),)
    assert m[("kvgate_prompt_fingerprints", (("tenant", "acme"),))] == 2


async def test_admin_prompts_lists_live_fingerprints_with_shares_and_preview_when_allowed(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    config = gateway_config([stub.url], normalization={"fingerprints": {"preview": True}})
    gw = await gateway_factory(config)
    long_prompt = "You are the assistant of Example Corp. " * 5
    for _ in range(3):
        await post(gw, chat(long_prompt))
    await post(gw, chat("Short."))
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/admin/prompts") as r:
        data = await r.json()
    rows = data["fingerprints"]
    assert [(row["requests"], row["share"]) for row in rows] == [(3, 0.75), (1, 0.25)]
    assert rows[0]["preview"] == long_prompt[:80]
    assert rows[0]["model"] == "stub-model" and len(rows[0]["fingerprint"]) == 16


async def test_admin_prompts_shows_no_prompt_text_by_default(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url]))
    await post(gw, chat("secret system prompt"))
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/admin/prompts") as r:
        text = await r.text()
    assert "secret" not in text and '"requests":1' in text.replace(" ", "")


async def test_the_request_carries_its_prefix_fingerprint_for_routing(stub_factory):
    stub = await stub_factory()
    app = build_app(gateway_config([stub.url]))
    seen: list[Exchange] = []

    @web.middleware
    async def keep_info(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        finally:
            seen.append(request[EXCHANGE])

    app.middlewares.append(keep_info)
    runner, url = await serve_app(app)
    gw = RunningGateway(url, app, runner)
    try:
        await gw.wait_healthy()
        await post(gw, chat("Same prompt.  "))
        await post(gw, chat("Same prompt."))
        await post(gw, {"model": "stub-model", "messages": [{"role": "user", "content": "x"}]})
    finally:
        await runner.cleanup()
    keys = [x.front.fingerprint for x in seen]
    assert keys[0] == keys[1] and isinstance(keys[0], str) and keys[2] is None


async def test_replica_prefix_cache_hit_ratio_is_exported_from_the_scrape(
    sim_factory, gateway_factory
):
    replica = await sim_factory(time_scale=0.01)
    gw = await gateway_factory(gateway_config([replica.url]))
    for i in range(4):
        await post(gw, chat("A shared system prompt. " * 20, f"q{i}") | {"model": "sim-model"})
    stats = replica.engine.stats
    expected = stats.prefix_cache_hits / stats.prefix_cache_queries
    key = ("kvgate_replica_prefix_cache_hit_ratio", (("replica", replica.url.removeprefix("http://")),))

    async def exported() -> bool:
        return math.isclose((await scrape(gw)).get(key, math.nan), expected)

    await eventually(exported, timeout_s=10, what=f"the exported hit ratio {expected}")
    assert 0 < expected < 1
