"""Two kvgate instances on one Redis enforce one tenant's tokens per minute between them.

Each instance builds its own store from `state: {backend: redis}`; requests hammer both at
once, and what the replica really served for the tenant (settled usage) must stay within the
bucket's capacity plus its refill over the run — and come close to it, so the limit is used,
not merely respected.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.plugins.gateway import RunningGateway, gateway_config, wait_settled
from tests.tenants.support import chat, metrics, post, sample

pytestmark = pytest.mark.redis

TOKENS_PER_MINUTE = 60_000  # a 60,000-token bucket refilled at 1,000 tokens/s
MAX_TOKENS = 292  # worst case ≈ 300 tokens per request (prompt ≈ 8-10)
LOAD_S = 3.0
WORKERS_PER_INSTANCE = 8
SLACK = 0.03


async def hammer(
    session: aiohttp.ClientSession, gw: RunningGateway, until: float, served: list[int]
) -> int:
    """Send requests back to back until `until`; record each answer's total tokens."""
    refused = 0
    while time.monotonic() < until:
        reply = await post(session, gw.url, chat(max_tokens=MAX_TOKENS))
        if reply.status == 200:
            served.append(reply.json()["usage"]["total_tokens"])
        else:
            assert reply.status == 429, reply
            refused += 1
    return refused


async def test_two_instances_on_one_redis_enforce_one_tokens_per_minute_limit(
    stub_factory, gateway_factory, redis_url, key_prefix
):
    stub = await stub_factory(chunks=MAX_TOKENS)  # the replica uses every token allowed
    config = gateway_config(
        [stub.url],
        auth={"mode": "none", "anonymous_tenant": "team"},
        tenants=[{"name": "team", "tokens_per_minute": TOKENS_PER_MINUTE}],
        # a loaded CI machine may be slow; a silent fallback to local limits would void the test
        state={"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix,
               "timeout_s": 2.0, "failure_mode": "fail_closed"},
    )
    instances = [await gateway_factory(config), await gateway_factory(config)]
    served: dict[str, list[int]] = {gw.url: [] for gw in instances}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        started = time.monotonic()
        refusals = await asyncio.gather(*(
            hammer(s, gw, started + LOAD_S, served[gw.url])
            for gw in instances for _ in range(WORKERS_PER_INSTANCE)
        ))
        elapsed = time.monotonic() - started
        for gw in instances:
            await wait_settled(gw)
        settled = 0.0
        for gw in instances:
            samples = await metrics(s, gw.url)
            for kind in ("prompt", "completion"):
                settled += sample(
                    samples, "kvgate_tenant_tokens_total", tenant="team", kind=kind
                ) or 0.0

    admitted = sum(sum(tokens) for tokens in served.values())
    allowed = TOKENS_PER_MINUTE + TOKENS_PER_MINUTE / 60 * elapsed
    print(
        f"\nshared tokens_per_minute: admitted {admitted} tokens in {elapsed:.2f}s "
        f"= {admitted / allowed:.1%} of capacity + refill ({allowed:.0f}); "
        f"{sum(len(v) for v in served.values())} requests served "
        f"({', '.join(str(len(v)) for v in served.values())} per instance), "
        f"{sum(refusals)} refused"
    )
    assert settled == admitted  # the instances charged what the replica reported
    assert all(served.values()), "both instances served some of the tenant's requests"
    assert sum(refusals) > 0, "the load went over the limit"
    assert admitted <= allowed * (1 + SLACK)
    assert admitted >= allowed * (1 - 2 * SLACK)
