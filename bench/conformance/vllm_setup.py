"""vLLM's real `Scheduler`, built offline on a CPU: no weights, no tokenizer, no hub.

A model directory holding only a small `config.json` is enough for `ModelConfig` with
`skip_tokenizer_init=True`; the KV cache is a `KVCacheConfig` of any number of blocks, one
full-attention group, as vLLM's own scheduler tests build it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.structured_output import StructuredOutputManager

from conformance.shape import EngineShape

EOS_TOKEN_ID = 2

# A tiny Llama: only the fields ModelConfig reads. Nothing is ever loaded from it.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 131072,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "rms_norm_eps": 1e-5,
}


def model_dir() -> Path:
    """A directory with the tiny model's config.json (made once per process)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        path = Path(tempfile.mkdtemp(prefix="kvgate-conformance-model-"))
        (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
        _MODEL_DIR = path
    return _MODEL_DIR


_MODEL_DIR: Path | None = None


def vllm_config(shape: EngineShape, *, asynchronous: bool = False) -> VllmConfig:
    scheduler = SchedulerConfig(
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy=shape.policy,  # type: ignore[arg-type]
        async_scheduling=asynchronous,
    )
    model = ModelConfig(
        model=str(model_dir()),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=shape.max_model_len,
    )
    cache = CacheConfig(
        block_size=shape.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=shape.enable_prefix_caching,
    )
    cache.num_gpu_blocks = shape.num_gpu_blocks
    return VllmConfig(
        scheduler_config=scheduler,
        model_config=model,
        cache_config=cache,
        device_config=DeviceConfig(device="cpu"),
        # its block pool records what it stores and evicts (the harness keeps the batches)
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )


def build_scheduler(shape: EngineShape, *, asynchronous: bool = False) -> Scheduler:
    """vLLM's own V1 scheduler over `shape.num_gpu_blocks` blocks (block 0 is the null block);
    `asynchronous`: its AsyncScheduler, as vLLM runs by default on GPUs."""
    config = vllm_config(shape, asynchronous=asynchronous)
    kv_cache = KVCacheConfig(
        num_blocks=shape.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=shape.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    kind = AsyncScheduler if asynchronous else Scheduler
    return kind(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=shape.block_size,
        log_stats=True,
    )
