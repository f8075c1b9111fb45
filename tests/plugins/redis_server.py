"""Redis for the tests: a shared server, per-test key prefixes, stores, and a private server.

`redis_url` (session): `REDIS_URL` if set; else a Redis already answering on 127.0.0.1:6379;
else a private `redis-server` started for the session. When none works the test fails under CI
(env `CI` non-empty) and is skipped elsewhere: CI must never silently skip the Redis tests.

`store` (function): each StateStore implementation in turn, with `store_time` to let time pass
for it (the memory store runs on a manual clock; Redis keeps its own, so that one sleeps).

`private_redis` (function): a throwaway redis-server on a free port that the test may `stop()` and
`start()` again on the same port, for outage tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import NoReturn

import pytest
import redis

from kvgate.state.base import StateStore
from kvgate.state.memory import MemoryStore
from kvgate.state.redis import RedisStore
from kvgate.state.resilient import ResilientStore
from tests.plugins.clock import ManualClock, ManualStoreTime, RealStoreTime, StoreTime
from tests.plugins.processes import free_port

_STARTUP_TIMEOUT_S = 10.0
# Looked up once at import, before any event loop runs (a PATH search stats files).
REDIS_SERVER = shutil.which("redis-server")


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"Redis is required under CI: {reason}", pytrace=False)
    pytest.skip(reason)


def _answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _server_command(port: int) -> list[str]:
    if REDIS_SERVER is None:
        _unavailable("no redis-server binary on PATH")
    return [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        if not _answers(url):
            pytest.fail(f"REDIS_URL={url} is set but does not answer PING", pytrace=False)
        yield url
        return
    if _answers("redis://127.0.0.1:6379/0"):
        yield "redis://127.0.0.1:6379/0"
        return
    port = free_port()
    process = subprocess.Popen(
        _server_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not _answers(url):
            if process.poll() is not None or time.monotonic() > deadline:
                _unavailable(f"could not start a private redis-server on port {port}")
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def key_prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A prefix unique to this test; its keys are deleted afterwards when the test used Redis."""
    prefix = f"kvgate-test:{uuid.uuid4().hex}"
    yield prefix
    if "redis_url" in request.fixturenames:
        url: str = request.getfixturevalue("redis_url")
        client = redis.Redis.from_url(url, socket_timeout=2)
        try:
            for pattern in (f"{{{prefix}:*", f"{prefix}:*"):
                keys = list(client.scan_iter(match=pattern, count=1000))
                if keys:
                    client.delete(*keys)
        finally:
            client.close()


@pytest.fixture
def memory_clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def memory_store(memory_clock: ManualClock) -> AsyncIterator[MemoryStore]:
    store = MemoryStore(clock=memory_clock)
    yield store
    await store.close()


@pytest.fixture
async def redis_store(redis_url: str, key_prefix: str) -> AsyncIterator[RedisStore]:
    store = RedisStore(redis_url, key_prefix=key_prefix, timeout_s=2.0)
    yield store
    await store.close()


@pytest.fixture
async def resilient_store(
    redis_store: RedisStore, memory_clock: ManualClock
) -> AsyncIterator[ResilientStore]:
    """Redis with a memory store to fall back on, as kvgate runs it with Redis: while Redis
    answers, the contract is kept through the wrapper."""
    fallback = MemoryStore(clock=memory_clock)
    store = ResilientStore(redis_store, fallback, "fail_open")
    yield store
    await fallback.close()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("resilient", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest) -> StateStore:
    """Each StateStore implementation in turn, for the contract suite."""
    implementation: StateStore = request.getfixturevalue(f"{request.param}_store")
    return implementation


@pytest.fixture
def store_time(request: pytest.FixtureRequest, store: StateStore) -> StoreTime:
    """Lets time pass for the `store` of this test: the memory store's clock moves at once;
    Redis keeps its own clock, so the test sleeps."""
    if request.node.callspec.params["store"] == "memory":
        return ManualStoreTime(request.getfixturevalue("memory_clock"))
    return RealStoreTime()


class PrivateRedis:
    """A redis-server of the test's own, on a fixed free port, that can be stopped and restarted."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._process: asyncio.subprocess.Process | None = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self) -> None:
        if self.running:
            return
        self._process = await asyncio.create_subprocess_exec(
            *_server_command(self.port),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not await _accepts(self.port):
            if self._process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"private redis-server on port {self.port} did not start")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Kill the server (like a crash: no shutdown handshake with its clients)."""
        if self._process is None:
            return
        if self._process.returncode is None:
            self._process.kill()
        await self._process.wait()
        self._process = None


async def _accepts(port: int) -> bool:
    """True once the server answers PING on `port`."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        writer.write(b"PING\r\n")
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), 1.0)).startswith(b"+PONG")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.fixture
async def private_redis() -> AsyncIterator[PrivateRedis]:
    if REDIS_SERVER is None:
        _unavailable("no redis-server binary on PATH for a private server")
    server = PrivateRedis(free_port())
    await server.start()
    yield server
    await server.stop()
