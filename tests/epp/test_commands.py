"""The commands around the picker: `kvgate envoy-config` writes a config Envoy accepts and
that serves; `kvgate demo --envoy` is the one command that runs Envoy, kvgate and the
simulated fleet; `--workers` above 1 is refused with the picker on."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import openai
import pytest
import yaml

from kvgate.cli import main
from kvgate.commands.serve import workers_refusal
from tests.plugins.envoy import epp_config, picker_of
from tests.plugins.gateway import wait_settled
from tests.plugins.processes import free_port


def write(path: Path, tree: dict) -> Path:
    path.write_text(yaml.safe_dump(tree))
    return path


def test_envoy_config_needs_the_picker_and_static_replicas(tmp_path, capsys):
    off = write(tmp_path / "off.yaml", {"pools": {"default": {"replicas": [
        {"url": "http://127.0.0.1:8001"}]}}})
    assert main(["envoy-config", str(off)]) == 2
    assert "server.epp.port" in capsys.readouterr().err
    dns = write(tmp_path / "dns.yaml", {"server": {"epp": {"port": 9002}}, "pools": {
        "default": {"dns": {"name": "vllm.example", "port": 8000}}}})
    assert main(["envoy-config", str(dns)]) == 2
    err = capsys.readouterr().err
    assert "found through DNS" in err and "no static replicas" in err


def test_workers_above_one_are_refused_with_the_picker():
    config = epp_config(["http://127.0.0.1:8001"], server={"port": 8080, "epp": {"port": 9002}},
                        state={"backend": "redis", "redis_url": "redis://127.0.0.1:6379/0"})
    assert "one process" in (workers_refusal(config, 2) or "")
    assert workers_refusal(config, 1) is None


async def test_envoy_config_writes_what_envoy_runs_in_front_of_kvgate(
    tmp_path, capsys, sim_factory, gateway_factory, envoy_bin
):
    replica = await sim_factory(time_scale=0.01)
    gw = await gateway_factory(epp_config([replica.url]))
    path = await asyncio.to_thread(write, tmp_path / "kvgate.yaml", {
        "server": {"epp": {"port": 9002}}, "pools": {"default": {"replicas": [
            {"url": replica.url}]}}})
    listen = free_port()
    code = await asyncio.to_thread(main, [  # the running gateway's picker as --picker
        "envoy-config", str(path), "--listen", f"127.0.0.1:{listen}",
        "--picker", picker_of(gw).address, "--response-body", "none",
    ])
    assert code == 0
    envoy_yaml = tmp_path / "envoy.yaml"
    text = capsys.readouterr().out
    await asyncio.to_thread(envoy_yaml.write_text, text)
    filters = yaml.safe_load(text)["static_resources"]["listeners"][0][
        "filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    ext_proc = filters[0]["typed_config"]
    assert ext_proc["processing_mode"]["response_body_mode"] == "NONE"
    # the pick may wait for its session's replica (0.25 s) and in the queue (60 s)
    assert ext_proc["message_timeout"] == "65.25s"
    process = await asyncio.create_subprocess_exec(
        envoy_bin, "-c", str(envoy_yaml), "--base-id", str(listen), "-l", "error",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{listen}/v1", api_key="x",
                                    max_retries=3)
        chat = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        )
        assert chat.usage.completion_tokens == 4
        await client.close()
        await wait_settled(gw)
    finally:
        process.terminate()
        await process.wait()


@pytest.mark.slow
async def test_demo_with_envoy_serves_the_openai_client_through_envoy(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate.cli", "demo", "--port", "0", "--envoy", str(port),
        "--time-scale", "0.05", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    assert demo.stdout is not None
    try:
        banner = b""
        async with asyncio.timeout(60):
            while b"Envoy is listening" not in banner:
                line = await demo.stdout.readline()
                assert line, f"the demo exited: {banner.decode()}"
                banner += line
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo",
                                    max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        )
        # Envoy sent it to one of the demo's replicas (the banner lists them)
        served = raw.headers["x-kvgate-replica"]
        assert served in banner.decode()
        assert raw.parse().choices[0].message.content
        await client.close()
    finally:
        demo.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            await demo.wait()
    assert demo.returncode == 0
