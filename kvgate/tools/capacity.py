"""KV-cache geometry and block arithmetic: the numbers behind admission and `kvgate plan`.

Everything here is pure — values in, values out — except `geometry_from_hf_config`, which
may read one `config.json`. The formulas follow vLLM (see vllm-reference.md §5):

    bytes per token per GPU = 2 (K and V) x layers x (kv_heads / tensor_parallel) x head_dim x dtype_bytes
    block bytes             = block_size x bytes per token
    available KV memory     = gpu_mem x gpu_memory_utilization - weights / tp - activations
    num_gpu_blocks          = available KV memory // block bytes

Units: memory sizes are GiB (2^30 bytes) unless a name says otherwise; a pool is counted in
blocks of `block_size` tokens; ratios are fractions in [0, 1].
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

GIB = 1 << 30

DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# vLLM measures peak activation memory by profiling one forward pass of
# max_num_batched_tokens, and subtracts non-torch memory (CUDA context, NCCL buffers, CUDA
# graphs). kvgate cannot profile, so it subtracts one fixed allowance for both. 2 GiB is
# what 7B-14B models at the default 8,192 batched tokens typically measure (about 1-1.5 GiB
# of activations plus 0.5 GiB non-torch); pass a larger value for 70B-class models or long
# max_num_batched_tokens. The error is at most a few percent of an 80 GB pool.
DEFAULT_ACTIVATION_GIB = 2.0


@dataclass(frozen=True)
class ModelGeometry:
    """The shape of a model's KV cache; `weights_gib` is the whole model's 16-bit weights."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    weights_gib: float | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.weights_gib is not None and self.weights_gib < 0:
            raise ValueError(f"{self.name}: weights_gib must be >= 0, got {self.weights_gib!r}")

    def kv_heads_per_gpu(self, tensor_parallel: int = 1) -> int:
        """KV heads one GPU holds: split evenly, or replicated when tp exceeds the head count."""
        _require_positive("tensor_parallel", tensor_parallel)
        if tensor_parallel <= self.num_kv_heads:
            if self.num_kv_heads % tensor_parallel:
                raise ValueError(
                    f"{self.name}: {self.num_kv_heads} KV heads cannot be split "
                    f"over tensor_parallel={tensor_parallel}"
                )
            return self.num_kv_heads // tensor_parallel
        if tensor_parallel % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: tensor_parallel={tensor_parallel} is not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )
        return 1  # vLLM replicates each KV head on tp / kv_heads GPUs

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tensor_parallel: int = 1) -> int:
        """Bytes of K and V one token occupies on one GPU (2 for fp16/bf16, 1 for fp8)."""
        _require_positive("dtype_bytes", dtype_bytes)
        heads = self.kv_heads_per_gpu(tensor_parallel)
        return 2 * self.num_layers * heads * self.head_dim * dtype_bytes


def _weights_gib(parameters: float) -> float:
    return parameters * 2 / GIB


def _preset(
    name: str, layers: int, kv_heads: int, head_dim: int, max_positions: int, parameters: float
) -> tuple[str, ModelGeometry]:
    return name, ModelGeometry(
        name, layers, kv_heads, head_dim, max_positions, _weights_gib(parameters)
    )


# The table of vllm-reference.md §5. Parameter counts (for 16-bit weights) are the model
# cards' totals, embeddings included.
PRESETS: Mapping[str, ModelGeometry] = MappingProxyType(
    dict(
        [
            _preset("llama-2-7b", 32, 32, 128, 4096, 6.74e9),
            _preset("llama-3.1-8b", 32, 8, 128, 131072, 8.03e9),
            _preset("llama-3.1-70b", 80, 8, 128, 131072, 70.6e9),
            _preset("mistral-7b", 32, 8, 128, 32768, 7.25e9),
            _preset("qwen2.5-7b", 28, 4, 128, 32768, 7.62e9),
            _preset("qwen2.5-14b", 48, 8, 128, 32768, 14.77e9),
            _preset("qwen2.5-72b", 80, 8, 128, 32768, 72.7e9),
            _preset("qwen3-8b", 36, 8, 128, 40960, 8.19e9),
            # DESIGN.md's generic "7B GQA model" (worked example 1).
            _preset("7b-gqa", 32, 8, 128, 32768, 7.0e9),
        ]
    )
)


def geometry_from_hf_config(
    source: str | os.PathLike[str] | Mapping[str, Any], *, name: str | None = None
) -> ModelGeometry:
    """Read a Hugging Face `config.json` (a path, or the parsed mapping).

    Multimodal configs keep the language model under `text_config`; that is used when the
    top level has no `num_hidden_layers`. Weights are unknown from a config: `weights_gib`
    is None. Raises ValueError naming the first missing or malformed key.
    """
    if isinstance(source, Mapping):
        config: Mapping[str, Any] = source
        where = "config"
    else:
        path = Path(source)
        where = str(path)
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"{where}: cannot read: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc.msg} (line {exc.lineno})") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"{where}: expected a JSON object")
        config = loaded
        if name is None:
            name = path.resolve().parent.name or None
    name = name or str(config.get("_name_or_path") or config.get("model_type") or "model")
    text_config = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text_config, Mapping):
        config = text_config
        where = f"{where}: text_config"

    def key(k: str) -> int:
        if k not in config or config[k] is None:
            raise ValueError(f"{where}: missing key {k!r}")
        value = config[k]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: {k!r} must be a positive integer, got {value!r}")
        return value

    layers = key("num_hidden_layers")
    attention_heads = key("num_attention_heads")
    kv_heads = key("num_key_value_heads") if config.get("num_key_value_heads") else attention_heads
    if config.get("head_dim"):
        head_dim = key("head_dim")
    else:
        hidden = key("hidden_size")
        if hidden % attention_heads:
            raise ValueError(
                f"{where}: hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {attention_heads}; give head_dim"
            )
        head_dim = hidden // attention_heads
    max_positions = key("max_position_embeddings")
    return ModelGeometry(name, layers, kv_heads, head_dim, max_positions)


def kv_pool_gib(
    geometry: ModelGeometry,
    gpu_mem_gib: float,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    weights_gib: float | None = None,
    tensor_parallel: int = 1,
    activation_gib: float = DEFAULT_ACTIVATION_GIB,
) -> float:
    """GiB left for the KV cache on one GPU; ValueError when nothing is left.

    `weights_gib` (default: the geometry's) is the whole model, split evenly over the
    `tensor_parallel` GPUs; `gpu_mem_gib` and the result are per GPU.
    """
    _require_positive("gpu_mem_gib", gpu_mem_gib)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
        )
    if activation_gib < 0:
        raise ValueError(f"activation_gib must be >= 0, got {activation_gib!r}")
    weights = geometry.weights_gib if weights_gib is None else weights_gib
    if weights is None:
        raise ValueError(f"{geometry.name}: weights size unknown; give weights_gib")
    if weights < 0:
        raise ValueError(f"weights_gib must be >= 0, got {weights!r}")
    _require_positive("tensor_parallel", tensor_parallel)
    budget = gpu_mem_gib * gpu_memory_utilization
    available = budget - weights / tensor_parallel - activation_gib
    if available <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {gpu_mem_gib:g} GiB x {gpu_memory_utilization:g}"
            f" = {budget:.1f} GiB, minus {weights / tensor_parallel:.1f} GiB of weights per GPU"
            f" and {activation_gib:g} GiB of activations, leaves {available:.1f} GiB"
        )
    return available


def num_gpu_blocks(
    geometry: ModelGeometry,
    gpu_mem_gib: float,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    weights_gib: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    dtype_bytes: int = 2,
    tensor_parallel: int = 1,
    activation_gib: float = DEFAULT_ACTIVATION_GIB,
) -> int:
    """Blocks vLLM would allocate per GPU (every GPU of a tp group holds the same count).

    ValueError when the memory left for KV does not hold a single block.
    """
    _require_positive("block_size", block_size)
    available = kv_pool_gib(
        geometry,
        gpu_mem_gib,
        gpu_memory_utilization,
        weights_gib,
        tensor_parallel,
        activation_gib,
    )
    block_bytes = block_size * geometry.kv_bytes_per_token(dtype_bytes, tensor_parallel)
    blocks = int(available * GIB) // block_bytes
    if blocks <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {available:.3f} GiB holds no "
            f"{block_bytes}-byte block"
        )
    return blocks


def blocks_for_tokens(tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks that hold `tokens` tokens: ceil(tokens / block_size)."""
    _require_positive("block_size", block_size)
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens!r}")
    return -(-tokens // block_size)


def worst_case_blocks(
    prompt_tokens: int, max_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """Blocks a request holds at its longest: ceil((prompt_tokens + max_tokens) / block_size)."""
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError(
            f"prompt_tokens and max_tokens must be >= 0, got {prompt_tokens!r}, {max_tokens!r}"
        )
    return blocks_for_tokens(prompt_tokens + max_tokens, block_size)


def max_concurrency(
    num_blocks: int, tokens_per_request: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """How many sequences of `tokens_per_request` tokens fit in `num_blocks` at once."""
    _require_positive("tokens_per_request", tokens_per_request)
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks!r}")
    return num_blocks // blocks_for_tokens(tokens_per_request, block_size)


def concurrency_factor(
    num_blocks: int, tokens_per_request: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> float:
    """vLLM's startup "Maximum concurrency for L tokens per request: X.XXx" (not floored)."""
    _require_positive("tokens_per_request", tokens_per_request)
    return num_blocks / blocks_for_tokens(tokens_per_request, block_size)


def usage_ratio(total_blocks: int, free_blocks: int) -> float:
    """What vLLM's `kv_cache_usage_perc` gauge shows: (total - free) / total."""
    _require_positive("total_blocks", total_blocks)
    _require_within("free_blocks", free_blocks, total_blocks)
    return (total_blocks - free_blocks) / total_blocks


def real_usage_ratio(total_blocks: int, free_blocks: int, reserved_unwritten_blocks: int) -> float:
    """Written usage: (total - free - reserved_unwritten) / total (DESIGN.md worked example 6)."""
    _require_positive("total_blocks", total_blocks)
    _require_within("free_blocks", free_blocks, total_blocks)
    _require_within(
        "reserved_unwritten_blocks", reserved_unwritten_blocks, total_blocks - free_blocks
    )
    return (total_blocks - free_blocks - reserved_unwritten_blocks) / total_blocks


def headroom_requests(
    capacity_blocks: int, reserved_blocks: int, worst_case_blocks_p95: int
) -> int:
    """How many more requests of `worst_case_blocks_p95` blocks fit; 0 when over-reserved."""
    _require_positive("worst_case_blocks_p95", worst_case_blocks_p95)
    if capacity_blocks < 0 or reserved_blocks < 0:
        raise ValueError(
            f"capacity_blocks and reserved_blocks must be >= 0, "
            f"got {capacity_blocks!r}, {reserved_blocks!r}"
        )
    return max(0, capacity_blocks - reserved_blocks) // worst_case_blocks_p95


def _require_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _require_within(name: str, value: int, upper: int) -> None:
    if not 0 <= value <= upper:
        raise ValueError(f"{name} must be in [0, {upper}], got {value!r}")
