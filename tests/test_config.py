"""The configuration: errors that name the key path, unknown keys refused, every problem
reported at once, `${ENV}` interpolation, secrets masked, `kvgate check-config`, and the
command-line flags that win over the file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.cli import main
from kvgate.commands.serve import config_loader
from kvgate.config import ConfigError, load_config, masked, parse_config

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "kvgate.yaml"
REPLICA = {"url": "http://127.0.0.1:8001"}


def minimal(**sections: Any) -> dict[str, Any]:
    return {"pools": {"default": {"replicas": [REPLICA]}}, **sections}


def problems(tree: Any, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(tree, env or {})
    assert str(caught.value) == "\n".join(caught.value.problems)
    return caught.value.problems


def test_a_bad_value_is_reported_with_its_key_path():
    tree = {"pools": {"long": {"replicas": [REPLICA, {"url": "ftp://gpu-b:8000"}]}}}
    assert problems(tree) == ["pools.long.replicas[1].url: not an http(s) URL"]


def test_unknown_keys_are_errors_at_the_top_and_nested():
    tree = minimal(bogus=1, server={"port": 80, "colour": "red"})
    tree["pools"]["default"]["replicas"] = [{**REPLICA, "weight": 2}]
    assert sorted(problems(tree)) == [
        "bogus: unknown key",
        "pools.default.replicas[0].weight: unknown key",
        "server.colour: unknown key",
    ]


def test_every_problem_is_reported_together():
    tree = minimal(
        server={"port": 70000, "max_body_bytes": 0},
        admission={"target_utilization": 1.5},
        state={"backend": "carrier-pigeon"},
    )
    found = problems(tree)
    assert len(found) == 4
    assert [p.split(":")[0] for p in found] == [
        "server.port", "server.max_body_bytes", "admission.target_utilization", "state.backend",
    ]
    assert "less than or equal to 65535" in found[0]


def test_missing_pools_is_reported_as_required():
    assert problems({}) == ["pools: required"]
    assert problems({"pools": {"default": {"replicas": []}}}) == [
        "pools.default: a pool needs replicas, a dns name or an inference_pool"
    ]


def test_broken_references_are_all_reported_each_with_its_path():
    tree = minimal(
        tenants=[{"name": "acme", "pools": ["gold"]}, {"name": "acme"}],
        auth={"anonymous_tenant": "guest"},
    )
    tree["pools"]["default"]["overflow_to"] = "nowhere"
    assert problems(tree) == [
        "pools.default.overflow_to: no pool named 'nowhere'",
        "tenants: names must be unique",
        "auth.anonymous_tenant: no tenant named 'guest'",
        "tenants.acme.pools: no pool named 'gold'",
    ]


def test_a_replica_in_two_pools_is_refused():
    tree = {"pools": {"a": {"replicas": [REPLICA]}, "b": {"replicas": [REPLICA]}}}
    assert problems(tree) == ["pools.b: replica '127.0.0.1:8001' is also in pool 'a'"]


def test_redis_backend_needs_a_url():
    assert problems(minimal(state={"backend": "redis"})) == ["state: backend redis needs redis_url"]


def test_tenant_key_digests_must_be_lowercase_sha256():
    found = problems(minimal(tenants=[{"name": "acme", "api_key_sha256": ["ABC"]}]))
    assert found == [
        "tenants[0].api_key_sha256: each entry must be a lowercase hex SHA-256 (64 characters)"
    ]


def test_env_variables_and_defaults_are_interpolated():
    tree = {
        "server": {"port": "${PORT}", "host": "${HOST:-0.0.0.0}"},
        "pools": {"default": {"replicas": [
            {"url": "http://${GPU_HOST}:8000", "api_key": "${KEY:-}"},
        ]}},
    }
    config = parse_config(tree, {"PORT": "9001", "GPU_HOST": "gpu-a"})
    assert config.server.port == 9001  # interpolated text still validates as a number
    assert config.server.host == "0.0.0.0"
    replica = config.pools["default"].replicas[0]
    assert replica.url == "http://gpu-a:8000"
    assert replica.api_key is not None and replica.api_key.get_secret_value() == ""


def test_a_set_variable_wins_over_its_default():
    config = parse_config(minimal(server={"host": "${HOST:-0.0.0.0}"}), {"HOST": "10.0.0.1"})
    assert config.server.host == "10.0.0.1"


def test_a_missing_env_variable_names_the_key_path():
    tree = {"pools": {"default": {"replicas": [REPLICA, {"url": "http://b:1", "api_key": "${VLLM_KEY}"}]}}}
    assert problems(tree) == [
        "pools.default.replicas[1].api_key: environment variable VLLM_KEY is not set"
    ]


def test_every_missing_env_variable_is_reported_together():
    tree = minimal(server={"host": "${HOST}", "port": "${PORT}"}, state={"key_prefix": "${P:-kv}"})
    assert problems(tree) == [
        "server.host: environment variable HOST is not set",
        "server.port: environment variable PORT is not set",
    ]


def test_the_process_environment_is_used_by_default(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVGATE_TEST_PORT", "9123")
    assert parse_config(minimal(server={"port": "${KVGATE_TEST_PORT}"})).server.port == 9123


def test_a_file_that_is_missing_or_not_yaml_or_not_a_mapping_names_the_file(tmp_path: Path):
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=f"^{missing}: No such file"):
        load_config(missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools: [unclosed\n")
    with pytest.raises(ConfigError, match=f"^{broken}: not valid YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(scalar)


def test_masked_config_hides_replica_keys_and_the_redis_password():
    config = parse_config(minimal(
        pools={"default": {"replicas": [{**REPLICA, "api_key": "replica-secret"}]}},
        state={"backend": "redis", "redis_url": "redis://kv:hunter2@redis.internal:6379/0"},
    ))
    data = masked(config)
    assert data["pools"]["default"]["replicas"][0]["api_key"] == "***"
    assert data["state"]["redis_url"] == "redis://kv:***@redis.internal:6379/0"
    assert "replica-secret" not in repr(data) and "hunter2" not in repr(data)


def test_config_is_frozen():
    config = parse_config(minimal())
    with pytest.raises(ValueError, match="frozen"):
        config.server.port = 1  # type: ignore[misc]


# ----------------------------------------------------------------- kvgate check-config


def write(path: Path, tree: Any) -> Path:
    path.write_text(yaml.safe_dump(tree))
    return path


def test_check_config_prints_the_resolved_config_with_secrets_masked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("KVGATE_TEST_REDIS_PW", "hunter2")
    monkeypatch.setenv("KVGATE_TEST_GPU_KEY", "sk-gpu-secret")
    path = tmp_path / "kvgate.yaml"
    path.write_text(
        "pools:\n"
        "  default:\n"
        "    replicas:\n"
        "      - url: http://gpu-a:8000\n"
        "        api_key: ${KVGATE_TEST_GPU_KEY}\n"
        "state:\n"
        "  backend: redis\n"
        "  redis_url: redis://:${KVGATE_TEST_REDIS_PW}@redis.internal:6379/0\n"
        "server:\n"
        "  port: ${KVGATE_TEST_PORT:-9100}\n"
    )
    assert main(["check-config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "hunter2" not in out + err and "sk-gpu-secret" not in out + err
    resolved = yaml.safe_load(out)
    assert resolved["server"]["port"] == 9100  # defaults filled in, variables resolved
    assert resolved["timeouts"]["first_byte_s"] == 120.0
    assert resolved["pools"]["default"]["replicas"][0]["api_key"] == "***"
    assert resolved["state"]["redis_url"] == "redis://:***@redis.internal:6379/0"
    assert f"{path}: valid" in err


def test_check_config_exits_2_naming_the_key_path_of_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = write(tmp_path / "bad.yaml", {
        "pools": {"long": {"replicas": [REPLICA, {"url": "gpu-b:8000"}]}},
        "bogus": True,
    })
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}: invalid" in err
    assert "pools.long.replicas[1].url: not an http(s) URL" in err
    assert "bogus: unknown key" in err


def test_check_config_refuses_a_tokenizer_that_cannot_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = write(tmp_path / "tok.yaml", minimal(
        models=[{"name": "m", "tokenizer": {"kind": "huggingface"}}]
    ))
    assert main(["check-config", str(path)]) == 2
    assert "tokenizer.file" in capsys.readouterr().err


def test_the_example_config_validates(capsys: pytest.CaptureFixture[str], monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-example-secret")
    assert main(["check-config", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "sk-example-secret" not in out
    resolved = yaml.safe_load(out)
    assert set(resolved["pools"]) == {"default", "long"}
    assert resolved["pools"]["long"]["overflow_to"] == "default"


def test_the_example_config_documents_every_option():
    """Each key of the schema appears in config/kvgate.yaml (commented or not)."""
    text = EXAMPLE.read_text()
    dumped = masked(parse_config(minimal()))
    missing = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if f"{key}:" not in text:
                    missing.append(key)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dumped)
    walk(parse_config(minimal(
        pools={"default": {"replicas": [{**REPLICA, "name": "x", "api_key": "k",
                                         "num_gpu_blocks": 1, "block_size": 16,
                                         "max_model_len": 8}]}},
        models=[{"name": "m"}], tenants=[{"name": "t"}],
    )).model_dump(mode="json"))
    assert missing == []


# ----------------------------------------------------------------- serve's flags and file


def serve_args(*argv: str) -> argparse.Namespace:
    from kvgate.commands.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_quick_start_flags_alone_make_a_default_pool():
    config = config_loader(serve_args(
        "--upstream", "http://gpu-a:8000", "--upstream", "http://gpu-b:8000", "--port", "9000"
    ))()
    assert [r.url for r in config.pools["default"].replicas] == [
        "http://gpu-a:8000", "http://gpu-b:8000",
    ]
    assert config.server.port == 9000
    assert config.state.backend == "memory"


def test_flags_win_over_the_file(tmp_path: Path):
    path = write(tmp_path / "kvgate.yaml", {
        "server": {"port": 8080, "host": "0.0.0.0", "drain_s": 5},
        "pools": {"main": {"replicas": [REPLICA]}},
        "state": {"backend": "memory", "key_prefix": "mine"},
    })
    config = config_loader(serve_args(
        "--config", str(path), "--upstream", "http://gpu-z:8000", "--port", "9999",
        "--host", "127.0.0.2", "--redis", "redis://127.0.0.1:6379/3",
        "--long-upstream", "http://gpu-long:8000",
    ))()
    assert [r.url for r in config.pools["main"].replicas] == ["http://gpu-z:8000"]
    assert [r.url for r in config.pools["long"].replicas] == ["http://gpu-long:8000"]
    assert config.pools["long"].min_worst_case_tokens == 16384
    assert (config.server.port, config.server.host, config.server.drain_s) == (9999, "127.0.0.2", 5)
    assert config.state.backend == "redis" and config.state.key_prefix == "mine"


def test_serve_needs_a_file_or_an_upstream():
    with pytest.raises(ConfigError, match="--config FILE or at least one --upstream"):
        config_loader(serve_args())()


def test_with_nothing_configured_requests_wait_a_minute_and_no_class_has_a_latency_target():
    config = parse_config(minimal(), {})
    queue = config.admission.queue
    assert queue.max_wait_s == 60
    assert all(queue.target(c) is None and queue.budget(c) == 60
               for c in ("critical", "standard", "sheddable"))
    assert config.default_model.default_max_tokens is None


def test_a_tenants_latency_target_wins_over_its_class():
    config = parse_config(minimal(
        admission={"queue": {"ttft_target_s": {"standard": 2}}},
        tenants=[{"name": "fast", "ttft_target_s": 0.5}, {"name": "plain"}],
    ), {})
    queue = config.admission.queue
    fast, plain = (config.tenant(n) for n in ("fast", "plain"))
    assert fast is not None and plain is not None
    assert queue.target(fast.priority, fast.ttft_target_s) == 0.5
    assert queue.target(plain.priority, plain.ttft_target_s) == 2
    assert queue.target("sheddable") is None


def test_the_old_wait_budget_key_loads_as_the_latency_target_with_a_warning_naming_it(
    caplog: pytest.LogCaptureFixture,
):
    config = parse_config(minimal(admission={"queue": {"wait_budget_s": {"standard": 2}}}), {})
    assert config.admission.queue.target("standard") == 2
    (warning,) = [r.getMessage() for r in caplog.records if "wait_budget_s" in r.getMessage()]
    assert "admission.queue.ttft_target_s" in warning
    assert problems(minimal(admission={"queue": {
        "wait_budget_s": {"standard": 2}, "ttft_target_s": {"standard": 1}}})) == [
        "admission.queue: wait_budget_s is the old name of ttft_target_s: set only ttft_target_s"
    ]


def test_a_session_wait_must_be_shorter_than_every_latency_target():
    assert problems(minimal(
        tenants=[{"name": "fast", "ttft_target_s": 0.2}],
        routing={"sessions": {"affinity_wait_s": 0.25}},
    )) == [
        "routing.sessions.affinity_wait_s: 0.25s must be shorter than the shortest latency "
        "target or max_wait_s (0.2s), or a session's request misses it waiting for its replica"
    ]
