"""Helpers shared by the tenant tests: API keys, requests, and reading /metrics."""

from __future__ import annotations

import hashlib
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.tenants import tenant_key
from tests.plugins import bodies, client
from tests.plugins.bodies import OMIT
from tests.plugins.client import Reply

MODEL = "stub-model"


def digest(key: str) -> str:
    """What the config holds for an API key: its SHA-256 in lowercase hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def chat(max_tokens: int = 5, *, stream: bool = False, model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return bodies.chat(model=model, max_tokens=max_tokens, stream=True if stream else OMIT,
                       **extra)


async def post(
    session: aiohttp.ClientSession, url: str, body: object, headers: dict[str, str] | None = None
) -> Reply:
    return await client.post(f"{url}/v1/chat/completions", body, http=session, headers=headers)


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample on /metrics, keyed by (name, labels)."""
    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def tokens_bucket(tenant: str) -> str:
    """The state-store key of a tenant's tokens-per-minute bucket (kvgate.tenants names it)."""
    return tenant_key(tenant, "tokens")


def concurrency_pool(tenant: str) -> str:
    """The state-store lease pool of a tenant's concurrent requests."""
    return tenant_key(tenant, "concurrency")


RATE_LIMIT_HEADERS = tuple(
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
)
