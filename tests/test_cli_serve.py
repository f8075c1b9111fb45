"""`kvgate serve` as a real process: a bad config never listens, the quick start runs in front
of one replica, and SIGHUP reloads the file (refusing a bad one, and leaving requests in flight
under the config they started with).

Each test starts one subprocess (about a second); stub replicas run in the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from kvgate.app import reload
from kvgate.cli import main
from tests.plugins.gateway import gateway_config
from tests.plugins.processes import CHAT, ROOT, chat, free_port, wait_ready


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give --config FILE or at least one --upstream URL"),
        (["--config", "/nonexistent/kvgate.yaml"], "/nonexistent/kvgate.yaml: No such file"),
        (["--upstream", "localhost:8000"], "pools.default.replicas[0].url: not an http(s) URL"),
    ],
)
def test_serve_refuses_to_start_without_a_valid_config(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_tokenizer_that_cannot_load(tmp_path: Path, capsys):
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump({
        "pools": {"default": {"replicas": [{"url": "http://127.0.0.1:9"}]}},
        "models": [{"name": "m", "tokenizer": {"kind": "tiktoken", "encoding": "o200k_base"}}],
    }))
    assert main(["serve", "--config", str(path)]) == 2
    assert "o200k_base" in capsys.readouterr().err


async def test_reload_refuses_a_tokenizer_that_cannot_load_and_keeps_the_old_config(
    stub_factory, gateway_factory
):
    stub = await stub_factory()
    config = gateway_config([stub.url])
    gw = await gateway_factory(config)
    bad = gateway_config([stub.url], models=[{"name": "m", "tokenizer": {"kind": "huggingface"}}])
    assert await reload(gw.app, lambda: bad) is False
    assert gw.gateway.runtime.config is config
    good = gateway_config([stub.url], default_model={"name": "*", "default_max_tokens": 7})
    assert await reload(gw.app, lambda: good) is True
    assert gw.gateway.runtime.config is good


async def test_serve_with_a_bad_config_exits_2_without_listening(start_kvgate, tmp_path: Path):
    port = free_port()
    path = tmp_path / "bad.yaml"
    await asyncio.to_thread(path.write_text, yaml.safe_dump({
        "server": {"port": port},
        "pools": {"default": {"replicas": [{"url": "gpu-a:8000"}]}},
        "tenants": [{"name": "acme", "colour": "red"}],
    }))
    kvgate = await start_kvgate("--config", str(path))
    assert await kvgate.exit_code() == 2
    assert "pools.default.replicas[0].url: not an http(s) URL" in kvgate.log
    assert "tenants[0].colour: unknown key" in kvgate.log
    assert "listening" not in kvgate.log


async def test_quick_start_serves_one_replica_from_flags_alone(start_kvgate, stub_factory):
    stub = await stub_factory(chunks=2)
    port = free_port()
    kvgate = await start_kvgate("--upstream", stub.url, "--port", str(port))
    await kvgate.wait_for(f"kvgate listening on http://127.0.0.1:{port}")
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url)
    status, headers, raw = await chat(url, {**CHAT, "max_tokens": 2})
    assert status == 200, raw
    assert orjson.loads(raw)["choices"][0]["message"]["content"] == "tok tok "
    assert headers["x-kvgate-replica"] == stub.url.removeprefix("http://")
    assert len(stub.received) == 1
    assert await kvgate.stop() == 0  # SIGTERM drains and exits cleanly


async def test_sighup_reloads_refuses_a_bad_file_and_spares_requests_in_flight(
    start_kvgate, stub_factory, tmp_path: Path
):
    gate = asyncio.Event()
    old = await stub_factory(chunks=3, gate=gate)  # streams wait at the gate after one chunk
    new = await stub_factory(chunks=3)
    path = tmp_path / "kvgate.yaml"
    file_port, port = free_port(), free_port()

    async def write(replica_url: str, default_max_tokens: int) -> None:
        await asyncio.to_thread(path.write_text, yaml.safe_dump({
            "server": {"port": file_port},  # the --port flag wins over this
            "discovery": {"interval_s": 0.1},
            "pools": {"default": {"replicas": [{"url": replica_url}]}},
            "models": [{"name": "stub-model", "default_max_tokens": default_max_tokens}],
        }))

    async def reload(reloads: int) -> None:
        kvgate.proc.send_signal(signal.SIGHUP)
        await kvgate.wait_for("config reloaded", count=reloads)

    await write(old.url, 11)
    kvgate = await start_kvgate("--config", str(path), "--port", str(port))
    await kvgate.wait_for(f"kvgate listening on http://127.0.0.1:{port}")
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url)
    assert (await chat(url))[0] == 200
    assert old.received[-1]["max_tokens"] == 11

    # A good file takes effect.
    await write(old.url, 22)
    await reload(1)
    assert (await chat(url))[0] == 200
    assert old.received[-1]["max_tokens"] == 22

    # A bad file is refused, logged, and the old config keeps serving.
    await asyncio.to_thread(path.write_text, "pools:\n  default:\n    replicas:\n      - url: not-a-url\nbogus: 1\n")
    kvgate.proc.send_signal(signal.SIGHUP)
    await kvgate.wait_for("config reload refused")
    await kvgate.wait_for("pools.default.replicas[0].url: not an http(s) URL")
    assert "bogus: unknown key" in kvgate.log
    status, headers, _ = await chat(url)
    assert status == 200
    assert old.received[-1]["max_tokens"] == 22
    assert headers["x-kvgate-replica"] == old.url.removeprefix("http://")

    # A stream in flight across a reload that moves the pool to another replica finishes on
    # the replica, and with the max_tokens, it started with.
    async with aiohttp.ClientSession() as session:
        stream = await session.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True})
        assert b"tok0" in await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 10)
        assert old.received[-1]["max_tokens"] == 22
        await write(new.url, 33)
        await reload(2)
        deadline = time.monotonic() + 10
        while True:  # new requests move to the new replica once discovery has seen it
            status, headers, _ = await chat(url)
            if status == 200:
                break
            assert status == 503 and time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert headers["x-kvgate-replica"] == new.url.removeprefix("http://")
        assert new.received[-1]["max_tokens"] == 33
        assert old.finished == 3 and not stream.content.at_eof()
        gate.set()
        rest = await asyncio.wait_for(stream.read(), 10)
        stream.release()
    assert b"tok2" in rest and rest.endswith(b"data: [DONE]\n\n")
    assert old.finished == 4
    assert await kvgate.stop() == 0


def quick(*argv: str) -> Any:
    import argparse

    from kvgate.commands.serve import add_arguments, config_loader

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_loader(parser.parse_args(list(argv)))()


def test_long_threshold_sets_up_two_pools_without_a_file():
    config = quick("--upstream", "http://a:8000", "--long-upstream", "http://b:8000",
                   "--long-threshold", "8000")
    assert config.pools["long"].min_worst_case_tokens == 8000
    assert [r.url for r in config.pools["long"].replicas] == ["http://b:8000"]
    assert quick("--upstream", "http://a:8000", "--long-upstream", "http://b:8000").pools[
        "long"
    ].min_worst_case_tokens == 16384


def test_long_threshold_without_a_long_pool_is_refused():
    from kvgate.config import ConfigError

    with pytest.raises(ConfigError, match="no long pool"):
        quick("--upstream", "http://a:8000", "--long-threshold", "8000")


async def test_sigterm_under_load_stops_accepting_finishes_streams_in_flight_and_exits_0(
    start_kvgate, stub_factory, tmp_path: Path
):
    gate = asyncio.Event()
    stub = await stub_factory(chunks=3, gate=gate)  # every stream waits after its first chunk
    path, port = tmp_path / "kvgate.yaml", free_port()
    await asyncio.to_thread(path.write_text, yaml.safe_dump({
        "server": {"port": port, "drain_s": 20}, "discovery": {"interval_s": 0.1},
        "pools": {"default": {"replicas": [{"url": stub.url}]}},
    }))
    kvgate = await start_kvgate("--config", str(path))
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url)
    async with aiohttp.ClientSession() as session:
        # a small max_tokens: all eight fit the stub's ledger at once (without one, each
        # would be bounded by the stub's whole context, and only three would)
        body = {**CHAT, "stream": True, "max_tokens": 8}
        streams = [await session.post(f"{url}/v1/chat/completions", json=body) for _ in range(8)]
        for stream in streams:  # all eight are mid-stream
            assert b"tok0" in await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 10)
        kvgate.proc.send_signal(signal.SIGTERM)
        await kvgate.wait_for("kvgate shutting down")
        deadline = time.monotonic() + 10
        while True:  # the listener closes: a new client is refused, not queued
            try:
                async with aiohttp.ClientSession() as fresh, fresh.post(
                    f"{url}/v1/chat/completions", json=CHAT) as r:
                    await r.read()
            except aiohttp.ClientConnectionError:
                break
            assert time.monotonic() < deadline, "kvgate kept accepting after SIGTERM"
            await asyncio.sleep(0.05)
        assert kvgate.proc.returncode is None  # still draining the eight
        gate.set()
        for stream in streams:
            rest = await asyncio.wait_for(stream.read(), 10)
            stream.release()
            assert rest.endswith(b"data: [DONE]\n\n")
    assert await kvgate.exit_code() == 0
    assert "Traceback" not in kvgate.log


@pytest.mark.slow
async def test_a_stderr_nobody_reads_never_stalls_requests_and_no_log_line_is_lost(
    stub_factory, tmp_path: Path
):
    # A container runtime's log pipe under pressure: the 64 KiB pipe fills after ~200 access
    # lines. Logging from the event loop would block it there and every request with it.
    stub = await stub_factory()
    port = free_port()
    path = tmp_path / "kvgate.yaml"
    await asyncio.to_thread(path.write_text, yaml.safe_dump({
        "server": {"port": port, "access_log": True},
        "discovery": {"interval_s": 0.1},
        "pools": {"default": {"replicas": [{"url": stub.url}]}},
    }))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate.cli", "serve", "--config", str(path),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=dict(os.environ),
    )
    assert proc.stderr is not None
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(url)
        n = 600
        left = list(range(n))
        async with aiohttp.ClientSession() as session:

            async def client() -> None:
                while left:
                    left.pop()
                    async with session.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                        assert r.status == 200
                        await r.read()

            await asyncio.wait_for(asyncio.gather(*(client() for _ in range(8))), 30)
        seen = 0
        while seen < n:  # now drain the pipe: every line arrives
            line = await asyncio.wait_for(proc.stderr.readline(), 20)
            assert line, f"kvgate's log ended after {seen} of {n} access lines"
            seen += b"kvgate.access" in line
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.communicate(), 10)
