"""`kvgate plan`: how many KV blocks a model gets on a GPU, and what to configure.

    kvgate plan --model qwen2.5-14b --gpu-mem-gib 80 [--lengths lengths.txt] [--json]

The pure core is `build_plan(PlanInputs) -> Plan`; `run` only parses, reads files and prints;
observed lengths are read and summarized by `kvgate.tools.lengths`.

Recommendations, and the rules behind them (percentiles are nearest-rank):

- max_model_len: P99.9 of the observed total lengths (prompt + completion), rounded up to
  the next 2^k or 1.5 x 2^k and to a block multiple, capped at the model's positions.
- Long tail: when P99.9 > 4 x P50 (the tail is long next to the body) or P99 > max_model_len
  / 2 (one request in a hundred already needs half the context), a single pool lets a few
  long requests hold most blocks while short ones queue. Then the normal pool's max_model_len
  comes from P99 instead, and the requests above it go to a long-context pool whose
  max_model_len covers the longest observed.
- max_num_seqs: 75% of the sequences that fit at once at the P99 length (at max_model_len
  without --lengths), leaving room for the tail without preempting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate.tools import capacity
from kvgate.tools.capacity import GIB, ModelGeometry
from kvgate.tools.lengths import LengthStats, length_stats, read_lengths

LONG_TAIL_P999_OVER_P50 = 4.0
LONG_TAIL_P99_OVER_MAX_MODEL_LEN = 0.5
MAX_NUM_SEQS_SHARE = 0.75


@dataclass(frozen=True)
class PlanInputs:
    geometry: ModelGeometry
    gpu_mem_gib: float
    gpu_memory_utilization: float = capacity.DEFAULT_GPU_MEMORY_UTILIZATION
    weights_gib: float | None = None
    block_size: int = capacity.DEFAULT_BLOCK_SIZE
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int | None = None
    kv_dtype_bytes: int = 2
    tensor_parallel: int = 1
    activation_gib: float = capacity.DEFAULT_ACTIVATION_GIB
    lengths: tuple[int, ...] = ()


@dataclass(frozen=True)
class LongPool:
    """Requests longer than `threshold_tokens` go to replicas serving `max_model_len`."""

    threshold_tokens: int
    max_model_len: int
    share_of_requests: float
    reason: str


@dataclass(frozen=True)
class Plan:
    geometry: ModelGeometry
    weights_gib: float  # the whole model's; each of tensor_parallel GPUs holds a share
    gpu_mem_gib: float
    gpu_memory_utilization: float
    activation_gib: float
    tensor_parallel: int
    kv_dtype_bytes: int
    bytes_per_token: int  # per GPU
    bytes_per_token_kib: float
    kv_pool_gib: float  # per GPU
    total_blocks: int
    block_size: int
    gpu_kv_tokens: int
    max_model_len: int
    worst_case_blocks: int
    max_concurrency: int
    concurrency_factor: float
    vllm_log_line: str
    lengths: LengthStats | None
    p99_blocks: int | None
    max_concurrency_p99: int | None
    max_concurrency_p50: int | None  # the body of the distribution, for contrast
    recommended_max_model_len: int | None
    recommended_max_num_seqs: int
    long_pool: LongPool | None
    warnings: tuple[str, ...]


def round_context_len(tokens: int, block_size: int) -> int:
    """The smallest 2^k or 1.5 x 2^k >= tokens, rounded up to a multiple of block_size."""
    power = 1 << max(0, (tokens - 1).bit_length())  # the smallest 2^k >= tokens
    three_quarters = power * 3 // 4  # 1.5 x the power of two below it
    chosen = three_quarters if power >= 4 and three_quarters >= tokens else power
    return capacity.blocks_for_tokens(max(chosen, block_size), block_size) * block_size


def build_plan(inputs: PlanInputs) -> Plan:
    """The whole plan from values; ValueError on impossible inputs."""
    geometry, block_size = inputs.geometry, inputs.block_size
    max_model_len = inputs.max_model_len or geometry.max_position_embeddings
    if max_model_len > geometry.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds {geometry.name}'s "
            f"max_position_embeddings {geometry.max_position_embeddings}"
        )
    weights_gib = geometry.weights_gib if inputs.weights_gib is None else inputs.weights_gib
    if weights_gib is None:
        raise ValueError(f"{geometry.name}: weights size unknown; give --weights-gib")
    bytes_per_token = geometry.kv_bytes_per_token(inputs.kv_dtype_bytes, inputs.tensor_parallel)
    pool_gib = capacity.kv_pool_gib(
        geometry,
        inputs.gpu_mem_gib,
        inputs.gpu_memory_utilization,
        weights_gib,
        inputs.tensor_parallel,
        inputs.activation_gib,
    )
    total_blocks = capacity.num_gpu_blocks(
        geometry,
        inputs.gpu_mem_gib,
        inputs.gpu_memory_utilization,
        weights_gib,
        block_size,
        inputs.kv_dtype_bytes,
        inputs.tensor_parallel,
        inputs.activation_gib,
    )
    gpu_kv_tokens = total_blocks * block_size
    worst = capacity.blocks_for_tokens(max_model_len, block_size)
    factor = capacity.concurrency_factor(total_blocks, max_model_len, block_size)
    warnings: list[str] = []
    if total_blocks < worst:
        warnings.append(
            f"the KV pool ({gpu_kv_tokens:,} tokens) cannot hold one {max_model_len:,}-token "
            f"sequence: vLLM refuses to start; lower --max-model-len to {gpu_kv_tokens:,} "
            "or less, or add GPUs (tensor parallel)"
        )

    stats = length_stats(inputs.lengths) if inputs.lengths else None
    p99_blocks: int | None = None
    concurrency_p99: int | None = None
    concurrency_p50: int | None = None
    recommended_len: int | None = None
    long_pool: LongPool | None = None
    basis_blocks = worst
    if stats is not None:
        p99_blocks = capacity.blocks_for_tokens(stats.p99, block_size)
        concurrency_p99 = total_blocks // p99_blocks
        concurrency_p50 = capacity.max_concurrency(total_blocks, stats.p50, block_size)
        basis_blocks = p99_blocks
        recommended_len, long_pool = _recommend_lengths(
            stats, inputs.lengths, max_model_len, geometry.max_position_embeddings, block_size
        )
        too_long = sum(1 for n in inputs.lengths if n > max_model_len)
        if too_long:
            warnings.append(
                f"{too_long} observed requests ({too_long / stats.count:.2%}) are longer than "
                f"max_model_len {max_model_len:,}: vLLM refuses them"
            )
        beyond_model = sum(1 for n in inputs.lengths if n > geometry.max_position_embeddings)
        if beyond_model and max_model_len < geometry.max_position_embeddings:
            warnings.append(
                f"{beyond_model} observed requests are longer than {geometry.name}'s "
                f"max_position_embeddings {geometry.max_position_embeddings:,}: "
                "no pool of this model can serve them"
            )
        if recommended_len > gpu_kv_tokens:
            warnings.append(
                f"the recommended max_model_len {recommended_len:,} does not fit in the "
                f"KV pool ({gpu_kv_tokens:,} tokens)"
            )
    limit = total_blocks // basis_blocks
    recommended_seqs = max(1, math.floor(limit * MAX_NUM_SEQS_SHARE))
    if inputs.max_num_seqs is not None and inputs.max_num_seqs > limit:
        basis = "P99" if stats is not None else "max_model_len"
        warnings.append(
            f"--max-num-seqs {inputs.max_num_seqs} exceeds the {limit} {basis}-length "
            "sequences the pool holds: expect preemptions under load"
        )
    return Plan(
        geometry=geometry,
        weights_gib=weights_gib,
        gpu_mem_gib=inputs.gpu_mem_gib,
        gpu_memory_utilization=inputs.gpu_memory_utilization,
        activation_gib=inputs.activation_gib,
        tensor_parallel=inputs.tensor_parallel,
        kv_dtype_bytes=inputs.kv_dtype_bytes,
        bytes_per_token_kib=bytes_per_token / 1024,
        bytes_per_token=bytes_per_token,
        kv_pool_gib=pool_gib,
        total_blocks=total_blocks,
        block_size=block_size,
        gpu_kv_tokens=gpu_kv_tokens,
        max_model_len=max_model_len,
        worst_case_blocks=worst,
        max_concurrency=total_blocks // worst,
        concurrency_factor=factor,
        vllm_log_line=(
            f"GPU KV cache size: {gpu_kv_tokens:,} tokens, Maximum concurrency for "
            f"{max_model_len:,} tokens per request: {factor:.2f}x"
        ),
        lengths=stats,
        p99_blocks=p99_blocks,
        max_concurrency_p99=concurrency_p99,
        max_concurrency_p50=concurrency_p50,
        recommended_max_model_len=recommended_len,
        recommended_max_num_seqs=recommended_seqs,
        long_pool=long_pool,
        warnings=tuple(warnings),
    )


def _recommend_lengths(
    stats: LengthStats,
    lengths: Sequence[int],
    max_model_len: int,
    max_positions: int,
    block_size: int,
) -> tuple[int, LongPool | None]:
    def rounded(tokens: int) -> int:
        return min(round_context_len(tokens, block_size), max_positions)

    reasons = []
    if stats.p999 > LONG_TAIL_P999_OVER_P50 * stats.p50:
        reasons.append(f"P99.9 {stats.p999:,} > {LONG_TAIL_P999_OVER_P50:g} x P50 {stats.p50:,}")
    if stats.p99 > LONG_TAIL_P99_OVER_MAX_MODEL_LEN * max_model_len:
        reasons.append(
            f"P99 {stats.p99:,} > {LONG_TAIL_P99_OVER_MAX_MODEL_LEN:g} x max_model_len "
            f"{max_model_len:,}"
        )
    if reasons:
        normal_len, long_len = rounded(stats.p99), rounded(stats.max)
        longer = sum(1 for n in lengths if n > normal_len)
        if longer and long_len > normal_len:
            share = longer / len(lengths)
            return normal_len, LongPool(normal_len, long_len, share, "; ".join(reasons))
    return rounded(stats.p999), None


def load_geometry(model: str) -> ModelGeometry:
    """A preset name (case-insensitive), a config.json, or a directory holding one."""
    preset = capacity.PRESETS.get(model.lower())
    if preset is not None:
        return preset
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.exists() or path.suffix == ".json":
        return capacity.geometry_from_hf_config(path)
    raise ValueError(
        f"unknown model {model!r}: give a config.json or one of {', '.join(capacity.PRESETS)}"
    )


def render_text(plan: Plan) -> str:
    g = plan.geometry
    lines = [
        f"model               {g.name}: {g.num_layers} layers, {g.num_kv_heads} KV heads x "
        f"{g.head_dim}, max positions {g.max_position_embeddings:,}",
        f"KV bytes per token  {plan.bytes_per_token:,} ({plan.bytes_per_token_kib:g} KiB) per GPU"
        f" (dtype {plan.kv_dtype_bytes} bytes, tensor parallel {plan.tensor_parallel})",
        f"KV pool             {plan.kv_pool_gib:.2f} GiB per GPU = {plan.gpu_mem_gib:g} GiB x "
        f"{plan.gpu_memory_utilization:g} - {plan.weights_gib / plan.tensor_parallel:.2f} GiB "
        f"weights - {plan.activation_gib:g} GiB activations",
        f"total blocks        {plan.total_blocks:,} of {plan.block_size} tokens "
        f"({plan.gpu_kv_tokens:,} tokens)",
        f"worst case          {plan.worst_case_blocks:,} blocks per request at max_model_len "
        f"{plan.max_model_len:,} ({plan.worst_case_blocks * plan.block_size * plan.bytes_per_token / GIB:.2f} GiB)",
        f"max concurrency     {plan.max_concurrency:,} sequences at max_model_len",
    ]
    if plan.lengths is not None and plan.max_concurrency_p99 is not None:
        s = plan.lengths
        lines += [
            f"observed lengths    {s.count:,} requests: P50 {s.p50:,}  P99 {s.p99:,}  "
            f"P99.9 {s.p999:,}  max {s.max:,} tokens",
            f"max concurrency     {plan.max_concurrency_p99:,} sequences at P99 {s.p99:,} "
            f"({plan.p99_blocks:,} blocks each), {plan.max_concurrency_p50:,} at P50 {s.p50:,}",
        ]
    lines += ["", plan.vllm_log_line, ""]
    if plan.recommended_max_model_len is not None:
        basis = "P99" if plan.long_pool else "P99.9"
        lines.append(
            f"recommend --max-model-len {plan.recommended_max_model_len}"
            f"   ({basis} of observed lengths, rounded up)"
        )
    basis = "P99-length" if plan.lengths else "max_model_len"
    lines.append(
        f"recommend --max-num-seqs {plan.recommended_max_num_seqs}"
        f"   ({MAX_NUM_SEQS_SHARE:.0%} of the {basis} sequences that fit)"
    )
    if plan.long_pool is not None:
        pool = plan.long_pool
        lines.append(
            f"recommend a long-context pool: requests over {pool.threshold_tokens:,} tokens "
            f"({pool.share_of_requests:.2%}) to replicas with --max-model-len "
            f"{pool.max_model_len}   (long tail: {pool.reason})"
        )
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name or path to a config.json")
    parser.add_argument("--gpu-mem-gib", type=float, required=True, help="memory of one GPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--weights-gib", type=float, help="whole model's weights (default: preset's, 16-bit)"
    )
    parser.add_argument("--block-size", type=int, default=capacity.DEFAULT_BLOCK_SIZE)
    parser.add_argument("--max-model-len", type=int, help="default: max_position_embeddings")
    parser.add_argument("--max-num-seqs", type=int, help="vLLM's --max-num-seqs, to check")
    parser.add_argument("--kv-dtype-bytes", type=int, default=2, help="2 fp16/bf16, 1 fp8")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument(
        "--activation-gib",
        type=float,
        default=capacity.DEFAULT_ACTIVATION_GIB,
        help="peak activations + non-torch memory per GPU",
    )
    parser.add_argument(
        "--lengths", type=Path, help="observed total lengths: integers, CSV or JSONL"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        inputs = _inputs_from_args(args)
        plan = build_plan(inputs)
    except ValueError as exc:
        print(f"kvgate plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(plan), indent=2))
    else:
        print(render_text(plan))
    return 0


def _inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    positive = (
        "gpu_mem_gib",
        "block_size",
        "max_model_len",
        "max_num_seqs",
        "kv_dtype_bytes",
        "tensor_parallel",
        "gpu_memory_utilization",
    )
    for name in positive:
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(
                f"--{name.replace('_', '-')} must be a finite number > 0, got {value:g}"
            )
    for name in ("weights_gib", "activation_gib"):
        value = getattr(args, name)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise ValueError(
                f"--{name.replace('_', '-')} must be a finite number >= 0, got {value:g}"
            )
    geometry = load_geometry(args.model)
    lengths: tuple[int, ...] = ()
    if args.lengths is not None:
        lengths = read_lengths(args.lengths)
    return PlanInputs(
        geometry=geometry,
        gpu_mem_gib=args.gpu_mem_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weights_gib=args.weights_gib,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_dtype_bytes=args.kv_dtype_bytes,
        tensor_parallel=args.tensor_parallel,
        activation_gib=args.activation_gib,
        lengths=lengths,
    )
