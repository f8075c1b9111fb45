"""Small helpers shared by the simulator's tests."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from kvgate.sim.server import SimReplica
from tests.plugins import client

# A replica that answers in milliseconds: small pool, fast simulated GPU.
FAST = {"time_scale": 0.001, "num_gpu_blocks": 256, "max_model_len": 1024}


async def scrape(http: aiohttp.ClientSession, replica: SimReplica) -> dict[str, Any]:
    """The replica's /metrics, by family name."""
    async with http.get(replica.url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    for sample in families[name].samples:
        if sample.name == name + suffix and all(sample.labels.get(k) == v for k, v in labels.items()):
            return float(sample.value)
    raise KeyError(name + suffix)


async def post(
    http: aiohttp.ClientSession, replica: SimReplica, path: str, body: dict[str, Any]
) -> tuple[int, Any]:
    """POST a JSON body; the status and the decoded JSON answer."""
    reply = await client.post(replica.url + path, body, http=http)
    return reply.status, reply.json()


async def ok(
    http: aiohttp.ClientSession, replica: SimReplica, path: str, body: dict[str, Any]
) -> Any:
    """POST a JSON body that must succeed; the decoded JSON answer."""
    status, answer = await post(http, replica, path, body)
    assert status == 200, answer
    return answer


async def post_stream(
    http: aiohttp.ClientSession, replica: SimReplica, path: str, body: dict[str, Any]
) -> list[Any]:
    """POST a streaming request; its events decoded, `[DONE]` kept as the string."""
    status, _, raw = await client.post(replica.url + path, {**body, "stream": True}, http=http)
    assert status == 200, raw
    text = raw.decode()
    assert text.endswith("\n\n")
    return [
        "[DONE]" if event == "data: [DONE]" else orjson.loads(event.removeprefix("data: "))
        for event in text[:-2].split("\n\n")
    ]
