"""`kvgate serve --workers N` with a separate admin listener: every worker binds it, /metrics
there shows every worker, /admin/* still needs the token, and the API port serves neither."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.plugins.processes import chat, free_port, wait_ready

TOKEN = "admin-token-for-workers"


async def test_two_workers_share_the_admin_listener_and_its_scrape_shows_both(
    start_kvgate, stub_factory, redis_url, key_prefix, tmp_path: Path
):
    stub = await stub_factory()
    port, admin_port = free_port(), free_port()
    path = tmp_path / "kvgate.yaml"
    await asyncio.to_thread(path.write_text, yaml.safe_dump({
        "server": {"port": port, "admin": {
            "port": admin_port, "require_token": True,
            "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}},
        "pools": {"default": {"replicas": [{"url": stub.url}]}},
        "state": {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix},
    }))
    kvgate = await start_kvgate("--config", str(path), "--workers", "2")
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    await wait_ready(url)
    for _ in range(4):
        answer = await chat(url)
        assert answer[0] == 200, answer
    deadline = time.monotonic() + 20
    workers: set[str] = set()
    async with aiohttp.ClientSession() as http:
        while workers != {"0", "1"} and time.monotonic() < deadline:
            try:
                async with http.get(f"{admin}/metrics") as response:
                    text = await response.text()
            except aiohttp.ClientConnectionError:  # the admin listener is not up yet
                await asyncio.sleep(0.2)
                continue
            workers = {
                s.labels.get("worker", "")
                for f in text_string_to_metric_families(text) for s in f.samples
                if f.name == "kvgate_state_store_up"
            }  # fmt: skip
            await asyncio.sleep(0.2)
        assert workers == {"0", "1"}, kvgate.log
        async with http.get(f"{url}/metrics") as response:
            assert response.status == 404
        async with http.get(f"{admin}/admin/replicas") as response:
            assert response.status == 401
        async with http.get(f"{admin}/admin/replicas",
                            headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            assert response.status == 200
    assert await kvgate.stop() == 0
