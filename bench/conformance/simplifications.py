"""What kvgate's simulator deliberately leaves out of vLLM's scheduler, where vLLM does it,
and how much it matters: the report prints this table beside the measured traces.

Every entry is either off in vLLM's defaults for the models kvgate serves (so no trace with
default settings can show it) or outside the scheduler (so the harness cannot measure it and
says so).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Simplification:
    what: str
    vllm_code: str
    size: str


SIMPLIFICATIONS = (
    Simplification(
        "Synchronous scheduling: each step's tokens are known before the next step is "
        "scheduled. vLLM enables async scheduling by default on GPUs: it schedules step k+1 "
        "while step k runs, with one placeholder token per decoding request",
        "vllm/v1/core/sched/async_scheduler.py; EngineCore.step_with_batch_queue",
        "measured in aggregate (the table above): a request holds its slot and blocks a step "
        "longer, since its EOS is seen a step late; on the named traces up to 10 more "
        "iterations to drain (4%), peak blocks up to 4 higher, at most 1 more preemption, "
        "and one trace's finish order and hit tokens (16 of 5,136) differ",
    ),
    Simplification(
        "Step cost is a linear model (step_overhead_s + prefill tokens x prefill_token_s + "
        "decoding sequences x decode_seq_s), not measured GPU time",
        "the GPU model runner (vllm/v1/worker/)",
        "outside the scheduler: the harness compares steps, not seconds. Simulated latencies "
        "(TTFT, e2e) are as good as the cost model's defaults, which are not fitted here",
    ),
    Simplification(
        "watermark, long_prefill_token_threshold, prefill_schedule_interval, "
        "max_num_scheduled_tokens / max_num_active_seqs are not modelled",
        "SchedulerConfig (vllm/config/scheduler.py); Scheduler.schedule",
        "0 on every trace: each is off by default (watermark 0.0, threshold 0, interval 1, "
        "overrides None)",
    ),
    Simplification(
        "Speculative decoding, LoRA, multimodal encoder budgets, KV connectors (offload, "
        "disaggregated prefill), sliding-window and hybrid (Mamba) KV groups, pipeline and "
        "data parallel scheduling",
        "Scheduler.schedule's spec-decode, encoder, connector and Mamba branches; "
        "single_type_kv_cache_manager.py",
        "not modelled: one full-attention KV group, one engine. The simulator does not claim "
        "these workloads",
    ),
    Simplification(
        "Block hashes are Python's hash of (parent, token ids), not sha256 over CBOR with "
        "extra keys (LoRA, multimodal, cache_salt)",
        "vllm/v1/core/kv_cache_utils.py hash_block_tokens",
        "none observable on these traces: equal prefixes hash equal on both sides (the hit "
        "tokens and the free queue match at every step); cache_salt is not modelled",
    ),
    Simplification(
        "Output lengths are drawn from a configured distribution (the harness sets them "
        "explicitly, as the trace's EOS step)",
        "the model itself",
        "outside the scheduler: what a real model writes is the workload's, not vLLM's",
    ),
)
