"""Every knob of one simulated vLLM replica, validated once.

Capacity is either given (`num_gpu_blocks`) or computed from a model preset and a GPU
(`model_preset` + `gpu_mem_gib`), with vLLM's formula in `kvgate.tools.capacity`; a preset, when
set, overrides `num_gpu_blocks`.

Timing defaults are in the range of a 7B model on one H100 (bf16): about 6 ms of fixed cost
per engine step (scheduling, sampling, kernel launches), 0.08 ms per prefill token (about
12k prompt tokens/s) and 0.15 ms per decoding sequence (a 64-sequence decode step takes
about 16 ms, i.e. ~60 tokens/s per sequence).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.sim.faults import Faults
from kvgate.sim.kv_events import KVEventsConfig

OUTPUT_LEN_DISTS = ("max", "uniform", "lognormal")


@dataclass(frozen=True)
class SimConfig:
    # --- capacity
    num_gpu_blocks: int = 2048
    block_size: int = 16
    model_preset: str | None = None
    gpu_mem_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    weights_gib: float | None = None
    kv_dtype_bytes: int = 2
    enable_prefix_caching: bool = True
    # --- scheduler
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"  # or "priority", as vLLM's --scheduling-policy
    # A waiting request starts only when its whole prompt fits (vLLM's
    # scheduler_reserve_full_isl, on by default since 0.2x); False: its first chunk.
    reserve_full_prompt: bool = True
    # vLLM's own admission limits (None: none): 503 once the unfinished requests would exceed
    # max_num_queued_reqs, or once the prompts still in prefill hold max_num_queued_tokens
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # --- timing (simulated seconds) and the wall-clock scale
    step_overhead_s: float = 0.006
    prefill_token_s: float = 0.00008
    decode_seq_s: float = 0.00015
    time_scale: float = 1.0
    # --- output length: "max" (always max_tokens), "uniform" or "lognormal" fraction of it
    output_len_dist: str = "max"
    output_len_min_fraction: float = 0.1
    output_len_median_fraction: float = 0.3
    output_len_sigma: float = 0.8
    # --- server
    seed: int = 0
    served_model_name: str = "sim-model"
    api_key: str | None = None
    # vLLM's --kv-events-config, as JSON: publish what the prefix cache stores and evicts
    kv_events_config: str | None = None
    # vLLM's --data-parallel-rank, as one rank of an externally balanced data-parallel
    # deployment serves: its series carry `engine` = the rank, and its KV events are published
    # at the configured ports + the rank, each batch marked with it
    data_parallel_rank: int = 0
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if self.model_preset is not None:
            object.__setattr__(self, "num_gpu_blocks", self._preset_blocks())
        self._validate()

    def _preset_blocks(self) -> int:
        from kvgate.tools import capacity

        assert self.model_preset is not None
        presets = capacity.PRESETS
        if self.model_preset not in presets:
            raise ValueError(
                f"model_preset: unknown preset {self.model_preset!r} "
                f"(known: {', '.join(sorted(presets))})"
            )
        if self.gpu_mem_gib is None:
            raise ValueError("gpu_mem_gib: required with model_preset")
        return capacity.num_gpu_blocks(
            presets[self.model_preset],
            self.gpu_mem_gib,
            self.gpu_memory_utilization,
            weights_gib=self.weights_gib,
            block_size=self.block_size,
            dtype_bytes=self.kv_dtype_bytes,
        )

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The KV events publisher's settings; None while events are off."""
        return KVEventsConfig.parse(self.kv_events_config)

    def _validate(self) -> None:
        self.kv_events  # noqa: B018 (raises ValueError naming what is wrong)
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank: must be >= 0, got {self.data_parallel_rank}")
        positive = ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            limit = getattr(self, name)
            if limit is not None and limit < 0:
                raise ValueError(f"{name}: must be >= 0 or null, got {limit}")
        if self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks: must be >= 2, got {self.num_gpu_blocks}")
        for name in ("step_overhead_s", "prefill_token_s", "decode_seq_s", "time_scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be within (0, 1]")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy: {self.scheduling_policy!r} is not one of fcfs, priority"
            )
        if self.output_len_dist not in OUTPUT_LEN_DISTS:
            raise ValueError(
                f"output_len_dist: {self.output_len_dist!r} is not one of {OUTPUT_LEN_DISTS}"
            )
        if not 0 <= self.output_len_min_fraction <= 1 or not self.output_len_median_fraction > 0:
            raise ValueError("output_len fractions: min in [0, 1], median > 0")
        # vLLM refuses to start when one max_model_len request cannot fit in the KV cache.
        kv_tokens = (self.num_gpu_blocks - 1) * self.block_size
        if self.max_model_len > kv_tokens:
            raise ValueError(
                f"max_model_len: {self.max_model_len} tokens do not fit in the KV cache "
                f"({self.num_gpu_blocks} blocks x {self.block_size} = {kv_tokens} usable "
                "tokens); lower max_model_len or raise num_gpu_blocks"
            )

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's 'GPU KV cache size: N tokens'."""
        return (self.num_gpu_blocks - 1) * self.block_size

    @property
    def max_concurrency(self) -> float:
        """vLLM's 'Maximum concurrency for max_model_len tokens per request'."""
        return self.kv_cache_tokens / self.max_model_len

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SimConfig:
        """Build from a fleet file entry; unknown keys and wrong types raise naming the key."""
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key not in names:
                raise ValueError(f"{key}: unknown key (known: {', '.join(sorted(names))})")
            if key == "faults":
                if not isinstance(value, Mapping):
                    raise ValueError("faults: must be a mapping")
                try:
                    values[key] = Faults.from_mapping(value)
                except ValueError as exc:
                    raise ValueError(f"faults.{exc}") from exc
            else:
                values[key] = _coerce(key, value, hints[key])
        if "model_preset" in values and "num_gpu_blocks" in values:
            raise ValueError("num_gpu_blocks: give either num_gpu_blocks or model_preset")
        return cls(**values)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ValueError(f"{key}: must not be null")
    if bool in allowed:
        if isinstance(value, bool):
            return value
    elif int in allowed:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif float in allowed:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif str in allowed and isinstance(value, str):
        return value
    expected = " or ".join(t.__name__ for t in allowed if t is not type(None))
    raise ValueError(f"{key}: expected {expected}, got {value!r}")
