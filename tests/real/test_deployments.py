"""kvgate deployed as users deploy it, in front of real engines: as Envoy's endpoint picker;
two instances sharing limits and ledgers through Redis; and `kvgate serve` started in a session
of its own beside busy engines, whose late health answers must not take them out of service."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from kvgate.state.redis import RedisStore
from kvgate.tools.tiny_model import MODEL_NAME
from kvgate.tools.vllm_cpu import free_port
from tests.plugins.envoy import epp_config
from tests.plugins.gateway import wait_released
from tests.plugins.waiting import eventually
from tests.real.conftest import real_config, wait_idle

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def chat(i: int, max_tokens: int = 24, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Question {i}: what is in the cache?"}],
            **fields}  # fmt: skip


async def test_the_endpoint_picker_behind_envoy_serves_a_chat_and_a_stream(
    engines, gateway_factory, envoy_factory
):
    config = real_config(engines, ["a", "b"])
    tree = config.model_dump(mode="json")
    gw = await gateway_factory(epp_config([], pools=tree["pools"], models=tree["models"],
                                          discovery=tree["discovery"], timeouts=tree["timeouts"]))
    envoy = await envoy_factory(gw, [engines[n].url.removeprefix("http://") for n in "ab"])
    client = openai.AsyncOpenAI(base_url=f"{envoy.url}/v1", api_key="x", max_retries=0)
    answer = await client.chat.completions.create(**chat(1))
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    chunks = [c async for c in await client.chat.completions.create(
        **chat(2), stream=True, stream_options={"include_usage": True})]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    await client.close()
    await wait_released(gw)
    await wait_idle(engines["a"], engines["b"])


async def test_two_instances_on_redis_share_a_tenants_limit_and_the_ledgers(
    engines, gateway_factory, redis_url, key_prefix
):
    key = "real-tenant-key"
    tenants = [{"name": "solo", "max_concurrent": 1,
                "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}]  # fmt: skip
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix}
    config = real_config(engines, ["a", "b"], tenants=tenants, state=state,
                         auth={"mode": "api_key"})
    stores = [RedisStore(redis_url, key_prefix=key_prefix, timeout_s=2.0) for _ in range(2)]
    one, two = [await gateway_factory(config, store=store) for store in stores]
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        # a long stream through the first instance holds the tenant's one slot and its blocks
        held = await http.post(f"{one.url}/v1/chat/completions",
                               json=chat(1, 1500, stream=True, ignore_eos=True))  # fmt: skip
        assert held.status == 200
        await held.content.readline()
        replica = held.headers["X-Kvgate-Replica"]
        reserved = await two.store.held(f"ledger:{replica}")
        assert reserved > 0, "the second instance sees the first one's reservation"
        # the same tenant through the second instance: its one slot is taken
        async with http.post(f"{two.url}/v1/chat/completions", json=chat(2)) as refused:
            assert refused.status == 429, await refused.text()
            assert (await refused.json())["error"]["code"] == "rate_limit_exceeded"
        held.close()
        await eventually(lambda: released(two, replica), timeout_s=15,
                         what="the first instance's blocks released, seen by the second")
        async with http.post(f"{two.url}/v1/chat/completions", json=chat(3)) as served:
            assert served.status == 200, await served.text()
            await served.read()
    for gw in (one, two):
        await wait_released(gw)
    for store in stores:
        await store.close()
    await wait_idle(engines["a"], engines["b"])


async def released(gw: Any, replica: str) -> bool:
    return await gw.store.held(f"ledger:{replica}") == 0


async def test_kvgate_in_a_session_of_its_own_serves_beside_busy_engines(engines, tmp_path):
    """As a harness starts it (`start_new_session`), with its defaults, while the engines
    generate: every chat is served, and no replica is taken out of service for answering its
    checks late."""
    port = free_port()
    log = tmp_path / "kvgate.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate.cli", "serve", "--port", str(port),
            "--upstream", engines["a"].url, "--upstream", engines["b"].url,
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, cwd=ROOT,
            env=dict(os.environ), start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                try:
                    async with http.get(f"{url}/ready") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await eventually(ready, timeout_s=30, interval_s=0.2, what="kvgate ready")

            async def one(i: int) -> int:
                async with http.post(f"{url}/v1/chat/completions",
                                     json=chat(i, 200, stream=i % 2 == 1)) as r:  # fmt: skip
                    await r.read()
                    return r.status

            started, tasks = time.monotonic(), []
            for i in range(48):  # 4 chats a second for 12 s
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(max(0.0, started + (i + 1) / 4 - time.monotonic()))
            statuses = await asyncio.gather(*tasks)
            async with http.get(f"{url}/metrics") as r:
                metrics = await r.text()
    finally:
        process.terminate()
        await process.wait()
    text = await asyncio.to_thread(log.read_text)
    assert statuses == [200] * 48, (statuses, text[-3000:])
    assert "is unhealthy" not in text
    assert "kvgate_replica_healthy" in metrics
    await wait_idle(engines["a"], engines["b"])

