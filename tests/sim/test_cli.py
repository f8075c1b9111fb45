"""`kvgate sim`: flags, fleet files, and a real process that starts and stops cleanly."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from kvgate.cli import main as kvgate_main
from kvgate.sim import cli
from kvgate.sim.config import SimConfig
from kvgate.sim.faults import Faults
from kvgate.sim.fleet import FleetError, load_fleet, parse_fleet

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_map_to_config_keys_and_unset_flags_keep_the_defaults() -> None:
    args = parse("--num-gpu-blocks", "512", "--max-model-len", "4096", "--time-scale", "0.1",
                 "--no-prefix-caching", "--fault-error-rate", "0.2", "--fault-hang")  # fmt: skip
    overrides = cli.replica_overrides(args)
    assert overrides == {
        "num_gpu_blocks": 512,
        "max_model_len": 4096,
        "time_scale": 0.1,
        "enable_prefix_caching": False,
        "faults": {"error_rate": 0.2, "hang": True},
    }
    config = SimConfig.from_mapping(overrides)
    assert config.faults == Faults(error_rate=0.2, hang=True)
    assert config.max_num_seqs == SimConfig().max_num_seqs


def test_scheduler_flags_are_vllms() -> None:
    args = parse("--scheduling-policy", "priority", "--no-scheduler-reserve-full-isl")
    config = SimConfig.from_mapping(cli.replica_overrides(args))
    assert (config.scheduling_policy, config.reserve_full_prompt) == ("priority", False)
    unset = SimConfig.from_mapping(cli.replica_overrides(parse()))
    assert (unset.scheduling_policy, unset.reserve_full_prompt) == ("fcfs", True)


def test_queue_limit_flags_are_vllms_and_unset_they_limit_nothing() -> None:
    args = parse("--max-num-queued-reqs", "8", "--max-num-queued-tokens", "4096")
    config = SimConfig.from_mapping(cli.replica_overrides(args))
    assert (config.max_num_queued_reqs, config.max_num_queued_tokens) == (8, 4096)
    unset = SimConfig.from_mapping(cli.replica_overrides(parse()))
    assert (unset.max_num_queued_reqs, unset.max_num_queued_tokens) == (None, None)


def test_a_model_preset_computes_the_block_count() -> None:
    config = SimConfig.from_mapping({"model_preset": "qwen2.5-7b", "gpu_mem_gib": 80})
    assert config.num_gpu_blocks > 60_000  # 56 KiB per token on ~70 GiB
    with pytest.raises(ValueError, match="gpu_mem_gib"):
        SimConfig(model_preset="qwen2.5-7b")
    with pytest.raises(ValueError, match="unknown preset"):
        SimConfig(model_preset="gpt-9", gpu_mem_gib=80)
    assert cli.run(parse("--num-gpu-blocks", "9", "--model-preset", "qwen2.5-7b")) == 2


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="max_len: unknown key"):
        SimConfig.from_mapping({"max_len": 5})
    with pytest.raises(ValueError, match="max_num_seqs: expected int"):
        SimConfig.from_mapping({"max_num_seqs": "many"})
    with pytest.raises(ValueError, match="max_model_len: 8192 tokens do not fit"):
        SimConfig(num_gpu_blocks=100)


def test_the_example_fleet_has_two_normal_replicas_and_one_long_context_replica() -> None:
    specs = load_fleet(ROOT / "config" / "fleet.example.yaml")
    assert [s.port for s in specs] == [8001, 8002, 8003]
    normal, _, long = (s.config for s in specs)
    assert long.max_model_len > normal.max_model_len
    assert long.model_preset == "qwen2.5-7b" and long.num_gpu_blocks > normal.num_gpu_blocks


def test_fleet_errors_name_the_entry_and_key() -> None:
    with pytest.raises(FleetError, match=r"replicas\[1\]\.bogus: unknown key"):
        parse_fleet([{"port": 1}, {"port": 2, "bogus": 1}])
    with pytest.raises(FleetError, match=r"replicas\[0\]\.port"):
        parse_fleet({"replicas": [{"num_gpu_blocks": 10}]})
    with pytest.raises(FleetError, match="share a host and port"):
        parse_fleet([{"port": 5}, {"port": 5}])
    with pytest.raises(FleetError, match=r"replicas\[0\]\.faults\.explode: unknown fault"):
        parse_fleet([{"port": 5, "faults": {"explode": True}}])


@pytest.mark.slow
async def test_kvgate_sim_serves_announces_its_capacity_and_exits_cleanly_on_sigint() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate.cli", "sim", "--port", "0", "--num-gpu-blocks", "128",
        "--max-model-len", "512", "--time-scale", "0.01",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert "num_gpu_blocks=128" in line and "kv_cache_tokens=2032" in line
        url = line.split()[1]
        async with aiohttp.ClientSession() as http, http.get(url + "/health") as response:
            assert response.status == 200
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_help_names_the_chat_template_the_simulator_renders(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        kvgate_main(["sim", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ChatML template" in text and "100264" in text and "100265" in text
