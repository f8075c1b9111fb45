"""The scheduler settings one trace runs under: the same values build vLLM's `VllmConfig` and
kvgate's `SimConfig`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineShape:
    """The scheduler settings a trace runs under; the same values build kvgate's SimConfig."""

    num_gpu_blocks: int = 257
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # or "priority"
