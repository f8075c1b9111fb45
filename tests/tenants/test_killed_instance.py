"""A kvgate killed with SIGKILL cannot release what it holds in Redis; its leases must expire
by themselves: the replica's block ledger and the tenant's concurrency count return to zero
within a few lease TTLs, while a live instance keeps its leases renewed past the TTL.

kvgate runs here as a real `kvgate serve --config FILE` subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kvgate.state.redis import RedisStore
from tests.plugins.gateway import StubUpstream
from tests.plugins.processes import free_port
from tests.plugins.waiting import eventually
from tests.tenants.support import chat, concurrency_pool

pytestmark = [pytest.mark.redis, pytest.mark.slow]

LEASE_TTL_S = 1.0
START_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def kvgate_serve(
    tree: dict[str, Any], tmp_path: Path
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """`kvgate serve --config FILE` in a subprocess, ready (its replica discovered)."""
    port = free_port()
    tree = {**tree, "server": {"host": "127.0.0.1", "port": port, "drain_s": 0}}
    config = tmp_path / "kvgate.yaml"
    await asyncio.to_thread(config.write_text, yaml.safe_dump(tree))
    log = tmp_path / "kvgate.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config),
            "--log-level", "WARNING", stdout=out, stderr=out,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        async with aiohttp.ClientSession() as s:
            while True:
                if process.returncode is not None or time.monotonic() > deadline:
                    raise AssertionError(f"kvgate did not get ready:\n{log.read_text()}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(f"{url}/ready") as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.05)
        yield url, process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


def config_tree(stub: StubUpstream, redis_url: str, key_prefix: str) -> dict[str, Any]:
    return {
        "pools": {"default": {"replicas": [{"url": stub.url}]}},
        "discovery": {"interval_s": 0.1, "timeout_s": 1.0},
        "admission": {"lease_ttl_s": LEASE_TTL_S},
        "auth": {"mode": "none", "anonymous_tenant": "team"},
        "tenants": [{"name": "team", "max_concurrent": 4, "tokens_per_minute": 100_000}],
        "state": {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix,
                  "timeout_s": 2.0},
    }


async def lease_expires_after_sigkill(
    which: str, stub_factory: Any, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """Open a stream through a kvgate subprocess, hold it past the TTL (its lease in `which`
    pool must be renewed meanwhile), SIGKILL kvgate, and wait for the lease to expire."""
    stub = await stub_factory(chunks=5, gate=asyncio.Event())
    pools = {
        "ledger": f"ledger:{stub.url.removeprefix('http://')}",  # the replica id: host:port
        "concurrency": concurrency_pool("team"),
    }
    pool = pools[which]
    store = RedisStore(redis_url, key_prefix=key_prefix)
    try:
        async with (
            kvgate_serve(config_tree(stub, redis_url, key_prefix), tmp_path) as (url, process),
            aiohttp.ClientSession() as s,
        ):
            response = await s.post(f"{url}/v1/chat/completions", json=chat(stream=True))
            assert response.status == 200
            await response.content.readuntil(b"\n\n")
            assert await store.held(pool) > 0
            await asyncio.sleep(1.5 * LEASE_TTL_S)
            assert await store.held(pool) > 0, "a live instance renews its leases"
            process.send_signal(signal.SIGKILL)
            await process.wait()
            killed_at = time.monotonic()

            async def expired() -> bool:
                return await store.held(pool) == 0

            await eventually(expired, timeout_s=3 * LEASE_TTL_S, what=f"{pool} back to 0")
            print(f"\n{pool}: back to 0 {time.monotonic() - killed_at:.2f}s after SIGKILL "
                  f"(lease TTL {LEASE_TTL_S}s)")
            response.close()
    finally:
        await store.close()


async def test_a_killed_instances_ledger_leases_expire(
    stub_factory, redis_url, key_prefix, tmp_path
):
    await lease_expires_after_sigkill("ledger", stub_factory, redis_url, key_prefix, tmp_path)


async def test_a_killed_instances_tenant_concurrency_lease_expires(
    stub_factory, redis_url, key_prefix, tmp_path
):
    await lease_expires_after_sigkill(
        "concurrency", stub_factory, redis_url, key_prefix, tmp_path
    )
