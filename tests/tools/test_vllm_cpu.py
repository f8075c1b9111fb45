"""The real-engine launcher's pure parts: the tiny model made the same every time, and the
flags an engine is started with. Starting engines is tests/real's (`./scripts/vllm-cpu test`)."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

from kvgate.request.chat_template import content_format, load_template
from kvgate.tools import tiny_model
from kvgate.tools.vllm_cpu import Engine, EngineSpec, parse_args


def test_the_tiny_model_is_the_same_bytes_every_time(tmp_path: Path):
    one = tiny_model.make_model(tmp_path / "one")
    two = tiny_model.make_model(tmp_path / "two")
    assert tiny_model.fingerprint(one) == tiny_model.fingerprint(two)
    config = json.loads((one / "config.json").read_text())
    assert config["vocab_size"] == tiny_model.VOCAB_SIZE
    assert load_template(one / "tokenizer_config.json").content_format == "openai"
    assert content_format(tiny_model.STRING_TEMPLATE) == "string"


def test_an_engine_is_started_with_the_flags_its_spec_asks_for(tmp_path: Path):
    spec = EngineSpec(num_blocks=64, kv_events=True, max_num_queued_reqs=2,
                      scheduling_policy="priority", cpus="1")  # fmt: skip
    engine = Engine(spec, tmp_path)
    command = engine.command()
    flags = dict(itertools.pairwise(command))  # each flag to the word after it
    assert flags["--num-gpu-blocks-override"] == "64" and flags["--block-size"] == "32"
    assert flags["--max-model-len"] == str(63 * 32)  # one request of full length must fit
    assert flags["--max-num-queued-reqs"] == "2" and flags["--scheduling-policy"] == "priority"
    assert json.loads(flags["--kv-events-config"])["endpoint"].startswith("tcp://*:")
    assert "--enforce-eager" in command and "--load-format" in command
    env = engine.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and "VLLM_SERVER_DEV_MODE" not in env
    assert Engine(EngineSpec(), tmp_path).environment()["OMP_NUM_THREADS"] == "1"


def test_serve_pins_each_engine_to_a_core_unless_told_not_to():
    specs, model_dir = parse_args(["--engines", "3", "--blocks", "128", "--kv-events"])
    assert [s.cpus for s in specs] == [str(i % (os.cpu_count() or 1)) for i in range(3)]
    assert all(s.num_blocks == 128 and s.kv_events for s in specs) and model_dir is None
    specs, _ = parse_args(["--unpinned"])
    assert [s.cpus for s in specs] == [None]


def test_an_engine_that_failed_to_start_says_why_before_its_last_lines(tmp_path: Path):
    """The engine core's own error comes long before the API server's last words."""
    engine = Engine(EngineSpec(), tmp_path)
    engine.log_path = tmp_path / "engine.log"
    cause = ["(EngineCore pid=7) ERROR 12-07 16:47:01 [core.py:1] EngineCore failed to start.",
             "Traceback (most recent call last):", "OSError: [Errno 98] Address in use"]
    noise = [f"  File 'frame{i}.py', line {i}" for i in range(100)]
    engine.log_path.write_text("\n".join(["INFO starting", *cause, *noise,
                                           "RuntimeError: Engine core initialization failed"]))
    told = engine.log_tail()
    assert "Address in use" in told and told.endswith("Engine core initialization failed")
    engine.log_path.write_text("INFO one\nINFO two")  # nothing failed: just its last lines
    assert engine.log_tail() == "INFO one\nINFO two"
