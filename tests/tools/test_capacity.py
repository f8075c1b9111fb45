"""The KV arithmetic, checked against DESIGN.md's worked examples and vLLM's reference table."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvgate.tools.capacity import (
    GIB,
    PRESETS,
    ModelGeometry,
    blocks_for_tokens,
    concurrency_factor,
    geometry_from_hf_config,
    headroom_requests,
    kv_pool_gib,
    max_concurrency,
    num_gpu_blocks,
    real_usage_ratio,
    usage_ratio,
    worst_case_blocks,
)

MIB = 1 << 20

# vllm-reference.md §5: bytes per token at 16 bits, tensor parallel 1.
REFERENCE_BYTES_PER_TOKEN = {
    "llama-2-7b": 524_288,
    "llama-3.1-8b": 131_072,
    "llama-3.1-70b": 327_680,
    "mistral-7b": 131_072,
    "qwen2.5-7b": 57_344,
    "qwen2.5-14b": 196_608,
    "qwen2.5-72b": 327_680,
    "qwen3-8b": 147_456,
    "7b-gqa": 131_072,
}


@pytest.mark.parametrize(("preset", "expected"), sorted(REFERENCE_BYTES_PER_TOKEN.items()))
def test_every_preset_matches_the_reference_tables_bytes_per_token(
    preset: str, expected: int
) -> None:
    assert PRESETS[preset].kv_bytes_per_token() == expected


def test_every_preset_is_in_the_reference_table_and_has_weights() -> None:
    assert set(PRESETS) == set(REFERENCE_BYTES_PER_TOKEN)
    assert all(g.weights_gib is not None and g.weights_gib > 0 for g in PRESETS.values())


def test_preset_weights_are_parameters_times_two_bytes() -> None:
    assert PRESETS["qwen2.5-14b"].weights_gib == pytest.approx(14.77e9 * 2 / GIB)
    assert PRESETS["llama-3.1-70b"].weights_gib == pytest.approx(70.6e9 * 2 / GIB)


# Worked example 1
def test_example_1_a_7b_gqa_model_holds_256_mib_for_2048_tokens() -> None:
    model = ModelGeometry("7b-gqa", 32, 8, 128, 32768)
    assert model.kv_bytes_per_token() == 131_072
    assert 2048 * model.kv_bytes_per_token() == 256 * MIB


# Worked example 2
def test_example_2_llama_2_7b_is_mha_and_four_times_larger() -> None:
    model = PRESETS["llama-2-7b"]
    assert model.kv_bytes_per_token() == 524_288
    assert 4096 * model.kv_bytes_per_token() == 2 * GIB
    assert 2048 * model.kv_bytes_per_token() == 1 * GIB


# Worked example 3
def test_example_3_at_26_percent_two_requests_fit_or_only_one() -> None:
    total, used = 1000, 260
    free = total - used
    assert usage_ratio(total, free) == pytest.approx(0.26)
    assert worst_case_blocks(512, 4096, 16) == 288
    assert headroom_requests(total, used, 288) == 2
    assert worst_case_blocks(512, 8192, 16) == 544
    assert headroom_requests(total, used, 544) == 1


# Worked example 4
def test_example_4_max_model_len_sets_how_many_worst_cases_run_at_once() -> None:
    assert blocks_for_tokens(8192, 16) == 512
    assert max_concurrency(2000, 8192, 16) == 3
    assert blocks_for_tokens(4096, 16) == 256
    assert max_concurrency(2000, 4096, 16) == 7


# Worked example 5
def test_example_5_full_length_reservations_make_the_gauge_read_high() -> None:
    total = 20_000
    per_sequence = blocks_for_tokens(32_768, 16)
    assert per_sequence == 2048
    reserved = 8 * per_sequence
    assert reserved == 16_384
    assert reserved / total == pytest.approx(0.8192)
    written = 2000
    free = total - reserved - written
    assert round(usage_ratio(total, free), 3) == 0.919
    assert real_usage_ratio(total, free, reserved_unwritten_blocks=reserved) == pytest.approx(0.10)


# Worked example 6
def test_example_6_real_usage_excludes_reserved_unwritten_blocks() -> None:
    assert round(usage_ratio(20_000, 1_740), 3) == 0.913
    assert round(real_usage_ratio(20_000, 1_740, 8_900), 3) == 0.468


# Worked example 7, in units of 100 MB: a 50 GB pool is 500 units, 2.5 GB is 25.
def test_example_7_admission_must_use_the_worst_case_not_current_usage() -> None:
    pool, grown = 500, 25
    assert usage_ratio(pool, pool - 18 * grown) == pytest.approx(0.90)
    assert headroom_requests(pool, 18 * grown, grown) == 2
    now = 24 * 15
    assert usage_ratio(pool, pool - now) == pytest.approx(0.72)
    assert 24 * grown == 600 > pool
    assert headroom_requests(pool, 24 * grown, grown) == 0


# Worked example 8
def test_example_8_qwen2_5_14b_needs_96_gib_for_32_requests_of_16k() -> None:
    model = PRESETS["qwen2.5-14b"]
    assert model.kv_bytes_per_token() == 196_608
    assert 16_384 * model.kv_bytes_per_token() == 3 * GIB
    assert 32 * 16_384 * model.kv_bytes_per_token() == 96 * GIB
    gb80, gb29 = 80e9 / GIB, 29e9 / GIB
    blocks = num_gpu_blocks(
        model, gb80, gpu_memory_utilization=1.0, weights_gib=gb29, activation_gib=0
    )
    assert max_concurrency(blocks, 16_384, 16) < 32
    assert max_concurrency(blocks, 16_384, 16) == 15


def test_num_gpu_blocks_divides_what_is_left_after_weights_and_activations() -> None:
    model = PRESETS["qwen2.5-14b"]
    blocks = num_gpu_blocks(model, 80, 0.9, weights_gib=29, block_size=16, activation_gib=2)
    assert blocks == (41 * GIB) // (16 * 196_608) == 13_994


def test_fp8_kv_cache_holds_twice_the_blocks() -> None:
    model = PRESETS["llama-3.1-8b"]
    fp16 = num_gpu_blocks(model, 80, weights_gib=16, activation_gib=0)
    fp8 = num_gpu_blocks(model, 80, weights_gib=16, activation_gib=0, dtype_bytes=1)
    assert fp8 == 2 * fp16


def test_tensor_parallel_splits_kv_heads_and_weights_per_gpu() -> None:
    model = PRESETS["llama-3.1-70b"]
    assert model.kv_bytes_per_token(tensor_parallel=4) == 327_680 // 4
    assert kv_pool_gib(model, 80, 0.9, weights_gib=140, tensor_parallel=4, activation_gib=2) == (
        pytest.approx(72 - 35 - 2)
    )


def test_tensor_parallel_beyond_kv_heads_replicates_them() -> None:
    model = PRESETS["qwen2.5-7b"]  # 4 KV heads
    assert model.kv_bytes_per_token(tensor_parallel=8) == 2 * 28 * 1 * 128 * 2


def test_tensor_parallel_that_does_not_divide_kv_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split"):
        PRESETS["llama-3.1-8b"].kv_bytes_per_token(tensor_parallel=3)


def test_no_memory_left_for_kv_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        num_gpu_blocks(PRESETS["llama-3.1-70b"], 80)


def test_unknown_weights_are_a_value_error() -> None:
    model = ModelGeometry("x", 32, 8, 128, 4096)
    with pytest.raises(ValueError, match="weights size unknown"):
        num_gpu_blocks(model, 80)


def test_vllm_concurrency_factor_is_blocks_over_blocks_per_request() -> None:
    assert concurrency_factor(2000, 8192, 16) == pytest.approx(2000 / 512)


def test_blocks_for_tokens_rounds_up_and_zero_tokens_need_no_block() -> None:
    assert blocks_for_tokens(0, 16) == 0
    assert blocks_for_tokens(1, 16) == 1
    assert blocks_for_tokens(16, 16) == 1
    assert blocks_for_tokens(17, 16) == 2


@pytest.mark.parametrize(
    "call",
    [
        lambda: blocks_for_tokens(-1, 16),
        lambda: blocks_for_tokens(10, 0),
        lambda: worst_case_blocks(-1, 10, 16),
        lambda: max_concurrency(100, 0, 16),
        lambda: usage_ratio(0, 0),
        lambda: usage_ratio(10, 11),
        lambda: real_usage_ratio(10, 4, 7),
        lambda: headroom_requests(10, 0, 0),
        lambda: ModelGeometry("x", 0, 8, 128, 4096),
    ],
)
def test_impossible_arguments_are_value_errors(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()


def _write_config(tmp_path: Path, config: dict[str, object]) -> Path:
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


def test_hf_config_with_kv_heads_and_head_dim(tmp_path: Path) -> None:
    path = _write_config(
        tmp_path,
        {
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_size": 4096,
            "max_position_embeddings": 40960,
        },
    )
    model = geometry_from_hf_config(path)
    assert model == ModelGeometry("my-model", 36, 8, 128, 40960)
    assert model.kv_bytes_per_token() == REFERENCE_BYTES_PER_TOKEN["qwen3-8b"]


def test_hf_config_without_kv_heads_or_head_dim_is_mha_of_hidden_over_heads(
    tmp_path: Path,
) -> None:
    path = _write_config(
        tmp_path,
        {
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "hidden_size": 4096,
            "max_position_embeddings": 4096,
        },
    )
    model = geometry_from_hf_config(path)
    assert (model.num_kv_heads, model.head_dim) == (32, 128)
    assert model.kv_bytes_per_token() == REFERENCE_BYTES_PER_TOKEN["llama-2-7b"]


def test_hf_config_reads_the_text_config_of_a_multimodal_model() -> None:
    config = {
        "model_type": "llava",
        "vision_config": {"hidden_size": 1024},
        "text_config": {
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "hidden_size": 3584,
            "max_position_embeddings": 32768,
        },
    }
    model = geometry_from_hf_config(config)
    assert model.kv_bytes_per_token() == REFERENCE_BYTES_PER_TOKEN["qwen2.5-7b"]
    assert model.name == "llava"


def test_hf_config_missing_a_key_names_it() -> None:
    with pytest.raises(ValueError, match="missing key 'max_position_embeddings'"):
        geometry_from_hf_config(
            {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
        )


def test_hf_config_file_that_is_not_json_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        geometry_from_hf_config(path)
