"""Processes a test starts: `kvgate serve` (the `start_kvgate` fixture, its log read line by
line), and what a test asks of one (a free port, readiness, a chat). A test that uses
`start_kvgate` is marked `slow` (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.plugins.client import Reply, post

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}


def free_port(count: int = 1) -> int:
    """A free port on the loopback; with `count`, the first of that many free in a row (a
    data-parallel engine publishes at its ports + its rank)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + count <= 65536 and all(_free(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"no {count} free ports in a row")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Kvgate:
    """A `kvgate serve` subprocess whose stderr (its log) is collected line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._news = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace").rstrip("\n"))
            self._news.set()
        self._news.set()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    async def wait_for(self, text: str, count: int = 1, timeout_s: float = 20.0) -> None:
        """Until `text` has appeared on `count` log lines."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._news.clear()
            if sum(text in line for line in self.lines) >= count:
                return
            if self._reader.done():
                raise AssertionError(f"kvgate exited ({self.proc.returncode}):\n{self.log}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{text!r} not logged in {timeout_s}s:\n{self.log}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._news.wait(), remaining)

    async def exit_code(self, timeout_s: float = 20.0) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        await self._reader
        return code

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.terminate()
        try:
            return await self.exit_code(10.0)
        except TimeoutError:
            self.proc.kill()
            return await self.exit_code(10.0)


@pytest.fixture
async def start_kvgate() -> AsyncIterator[Callable[..., Awaitable[Kvgate]]]:
    started: list[Kvgate] = []

    async def start(*argv: str) -> Kvgate:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate.cli", "serve", *argv,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=dict(os.environ),
        )
        kvgate = Kvgate(proc)
        started.append(kvgate)
        return kvgate

    yield start
    for kvgate in started:
        with contextlib.suppress(ProcessLookupError):
            await kvgate.stop()


async def wait_ready(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{url}/ready") as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} not ready in {timeout_s}s")
            await asyncio.sleep(0.05)


async def chat(url: str, body: dict[str, Any] = CHAT) -> Reply:
    return await post(f"{url}/v1/chat/completions", body)
