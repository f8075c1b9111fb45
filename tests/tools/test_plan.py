"""`kvgate plan`, run through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.cli import main
from kvgate.tools.capacity import GIB
from kvgate.tools.lengths import LengthStats, length_stats, read_lengths
from kvgate.tools.plan import round_context_len

QWEN14 = ["plan", "--model", "qwen2.5-14b", "--gpu-mem-gib", "80", "--weights-gib", "29"]
# 80 GiB x 0.9 - 29 GiB weights - 2 GiB activations = 41 GiB = 13,994 blocks of 16 x 192 KiB.
QWEN14_BLOCKS = 13_994


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main([*QWEN14, *argv, "--json"]) == 0
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    return result


def error_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvgate plan: error: ")
    return lines[0]


def write_lognormal_lengths(path: Path) -> None:
    # 990 short chats of 500-1,489 tokens and 10 documents of 20,000-29,000: a long tail.
    short = [500 + i for i in range(990)]
    long = [20_000 + 1_000 * i for i in range(10)]
    path.write_text("# total tokens per request\n\n" + "\n".join(map(str, short + long)) + "\n")


def test_text_plan_prints_geometry_pool_and_vllms_startup_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(QWEN14) == 0
    out = capsys.readouterr().out
    assert "196,608 (192 KiB) per GPU" in out
    assert "41.00 GiB per GPU" in out
    assert f"{QWEN14_BLOCKS:,} of 16 tokens" in out
    assert "2,048 blocks per request at max_model_len 32,768 (6.00 GiB)" in out
    assert "6 sequences at max_model_len" in out
    tokens = QWEN14_BLOCKS * 16
    factor = QWEN14_BLOCKS / 2048
    assert (
        f"GPU KV cache size: {tokens:,} tokens, "
        f"Maximum concurrency for 32,768 tokens per request: {factor:.2f}x"
    ) in out
    assert "recommend --max-num-seqs 4 " in out  # 75% of 6


def test_json_plan_carries_the_same_facts(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys)
    assert plan["bytes_per_token"] == 196_608
    assert plan["bytes_per_token_kib"] == 192
    assert plan["kv_pool_gib"] == pytest.approx(41)
    assert plan["total_blocks"] == QWEN14_BLOCKS
    assert plan["gpu_kv_tokens"] == QWEN14_BLOCKS * 16
    assert plan["worst_case_blocks"] == 2048
    assert plan["max_concurrency"] == 6
    assert plan["lengths"] is None
    assert plan["long_pool"] is None
    assert plan["warnings"] == []
    assert plan["geometry"] == {
        "name": "qwen2.5-14b",
        "num_layers": 48,
        "num_kv_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "weights_gib": pytest.approx(14.77e9 * 2 / GIB),
    }


def test_example_8_sixteen_k_requests_fit_fewer_than_32_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = plan_json(capsys, "--max-model-len", "16384", "--max-num-seqs", "32")
    assert plan["worst_case_blocks"] == 1024
    assert plan["max_concurrency"] == 13
    assert plan["warnings"] == [
        "--max-num-seqs 32 exceeds the 13 max_model_len-length sequences the pool holds: "
        "expect preemptions under load"
    ]


def test_a_long_tail_gets_a_long_context_pool(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lengths = tmp_path / "lengths.txt"
    write_lognormal_lengths(lengths)
    plan = plan_json(capsys, "--lengths", str(lengths))
    assert plan["lengths"] == {
        "count": 1000,
        "p50": 999,
        "p99": 1489,
        "p999": 28_000,
        "max": 29_000,
    }
    assert plan["p99_blocks"] == 94
    assert plan["max_concurrency_p99"] == QWEN14_BLOCKS // 94 == 148
    assert plan["max_concurrency_p50"] == QWEN14_BLOCKS // 63 == 222
    assert plan["recommended_max_model_len"] == 1536
    assert plan["recommended_max_num_seqs"] == 111
    assert plan["long_pool"] == {
        "threshold_tokens": 1536,
        "max_model_len": 32768,
        "share_of_requests": 0.01,
        "reason": "P99.9 28,000 > 4 x P50 999",
    }


def test_text_plan_with_lengths_shows_p99_concurrency_and_recommendations(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lengths = tmp_path / "lengths.txt"
    write_lognormal_lengths(lengths)
    assert main([*QWEN14, "--lengths", str(lengths)]) == 0
    out = capsys.readouterr().out
    assert "1,000 requests: P50 999  P99 1,489  P99.9 28,000  max 29,000 tokens" in out
    assert "148 sequences at P99 1,489 (94 blocks each), 222 at P50 999" in out
    assert "recommend --max-model-len 1536 " in out
    assert "recommend --max-num-seqs 111 " in out
    assert "recommend a long-context pool: requests over 1,536 tokens (1.00%)" in out


def test_a_short_tail_sizes_max_model_len_from_p99_9(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(3000 + i) for i in range(1000)))
    plan = plan_json(capsys, "--lengths", str(lengths))
    assert plan["long_pool"] is None
    assert plan["recommended_max_model_len"] == 4096  # P99.9 3,998 rounded up


def test_lengths_csv_and_jsonl_sum_prompt_and_completion(tmp_path: Path) -> None:
    csv_file = tmp_path / "lengths.csv"
    csv_file.write_text("request_id,prompt_tokens,completion_tokens\na,100,20\n# skipped\nb,7,3\n")
    jsonl = tmp_path / "lengths.jsonl"
    jsonl.write_text(
        '{"prompt_tokens": 100, "completion_tokens": 20}\n\n{"prompt_tokens": 7, '
        '"completion_tokens": 3, "model": "m"}\n'
    )
    assert read_lengths(csv_file) == read_lengths(jsonl) == (120, 10)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("100\nabc\n", "lengths.txt: line 2: expected an integer"),
        ("a,b\n1,2\n", "CSV header lacks completion_tokens, prompt_tokens"),
        ('{"prompt_tokens": 1}\n', "line 1: expected a JSON object with prompt_tokens"),
        ("# only a comment\n\n", "no lengths found"),
        ("100\n0\n", "line 2: a total length must be > 0"),
    ],
)
def test_malformed_lengths_files_exit_2_naming_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, message: str
) -> None:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text(content)
    assert message in error_of(capsys, [*QWEN14, "--lengths", str(lengths)])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "gpt-5", "--gpu-mem-gib", "80"], "unknown model 'gpt-5'"),
        (
            ["plan", "--model", "qwen3-8b", "--gpu-mem-gib", "0"],
            "--gpu-mem-gib must be a finite number > 0",
        ),
        ([*QWEN14, "--gpu-mem-gib", "inf"], "--gpu-mem-gib must be a finite number > 0"),
        ([*QWEN14, "--weights-gib", "-1"], "--weights-gib must be a finite number >= 0"),
        ([*QWEN14, "--block-size", "-16"], "--block-size must be a finite number > 0"),
        ([*QWEN14, "--max-model-len", "65536"], "exceeds qwen2.5-14b's max_position_embeddings"),
        ([*QWEN14, "--tensor-parallel", "3"], "cannot be split over tensor_parallel=3"),
        (["plan", "--model", "llama-3.1-70b", "--gpu-mem-gib", "80"], "no memory left"),
        ([*QWEN14, "--lengths", "/nonexistent/lengths.txt"], "cannot read"),
        (["plan", "--model", "/nonexistent/config.json", "--gpu-mem-gib", "80"], "cannot read"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in error_of(capsys, argv)


def test_a_config_json_needs_weights_then_plans_like_the_preset(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "Qwen2.5-14B-Instruct" / "config.json"
    config.parent.mkdir()
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 48,
                "num_attention_heads": 40,
                "num_key_value_heads": 8,
                "hidden_size": 5120,
                "max_position_embeddings": 32768,
            }
        )
    )
    base = ["plan", "--model", str(config.parent), "--gpu-mem-gib", "80"]
    assert "weights size unknown; give --weights-gib" in error_of(capsys, base)
    assert main([*base, "--weights-gib", "29", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["geometry"]["name"] == "Qwen2.5-14B-Instruct"
    assert plan["total_blocks"] == QWEN14_BLOCKS


def test_a_pool_too_small_for_one_max_model_len_sequence_warns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu-mem-gib", "24", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["max_concurrency"] == 0
    assert any("cannot hold one 131,072-token sequence" in w for w in plan["warnings"])


def test_percentiles_are_nearest_rank() -> None:
    assert length_stats(list(range(1, 1001))) == LengthStats(1000, 500, 990, 999, 1000)
    assert length_stats([7]) == LengthStats(1, 7, 7, 7, 7)


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (1, 16),
        (16, 16),
        (17, 32),
        (33, 48),
        (3000, 3072),
        (4096, 4096),
        (4097, 6144),
        (9000, 12288),
    ],
)
def test_context_lengths_round_up_to_powers_of_two_or_one_and_a_half_times(
    tokens: int, expected: int
) -> None:
    assert round_context_len(tokens, 16) == expected


def test_p99_over_half_of_max_model_len_is_a_long_tail_too(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["1500"] * 500 + ["2000"] * 492 + ["3000"] * 8))
    plan = plan_json(capsys, "--max-model-len", "3072", "--lengths", str(lengths))
    assert plan["long_pool"] == {
        "threshold_tokens": 2048,
        "max_model_len": 3072,
        "share_of_requests": 0.008,
        "reason": "P99 2,000 > 0.5 x max_model_len 3,072",
    }


def test_observed_lengths_over_max_model_len_are_warned_about(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("1000\n" * 98 + "5000\n40000\n")
    plan = plan_json(capsys, "--max-model-len", "4096", "--lengths", str(lengths))
    assert plan["warnings"] == [
        "2 observed requests (2.00%) are longer than max_model_len 4,096: vLLM refuses them",
        "1 observed requests are longer than qwen2.5-14b's max_position_embeddings 32,768: "
        "no pool of this model can serve them",
    ]
