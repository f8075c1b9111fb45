"""The simulated engine, stepped by hand with exact expectations (block_size 4 for small numbers)."""

from __future__ import annotations

import dataclasses

import pytest

from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.request import ContextLengthError, FinishReason, Status

BASE = SimConfig(
    num_gpu_blocks=65,  # 64 usable blocks of 4 tokens
    block_size=4,
    max_model_len=64,
    max_num_seqs=16,
    max_num_batched_tokens=256,
)


def engine(**overrides: object) -> Engine:
    return Engine(dataclasses.replace(BASE, **overrides))  # type: ignore[arg-type]


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def run_to_completion(e: Engine, now: float = 0.0, limit: int = 10_000) -> float:
    for _ in range(limit):
        if not e.has_unfinished_requests():
            return now
        now = e.step(now).end_time
    raise AssertionError("the engine did not finish")


def test_blocks_are_allocated_as_tokens_are_computed_not_reserved_for_max_tokens() -> None:
    e = engine()
    request = e.add_request("r", prompt(10), max_tokens=20, now=0.0)
    blocks_per_step = []
    for _ in range(5):
        e.step(0.0)
        blocks_per_step.append(len(request.blocks))
    # 10 prompt tokens -> 3 blocks; decode computes tokens 11, 12, 13, 14 -> 3, 3, 4, 4 blocks.
    assert blocks_per_step == [3, 3, 3, 4, 4]
    assert e.pool.num_free_blocks == 64 - 4


def test_chunked_prefill_respects_max_num_batched_tokens() -> None:
    e = engine(max_num_batched_tokens=8)
    long = e.add_request("long", prompt(20), max_tokens=4, now=0.0)
    e.add_request("short", prompt(6, 2000), max_tokens=4, now=0.0)
    steps = [e.step(0.0) for _ in range(4)]
    assert [s.scheduled for s in steps] == [
        {"long": 8},
        {"long": 8},
        {"long": 4, "short": 4},
        {"long": 1, "short": 2},
    ]
    assert [len(s.outputs) for s in steps] == [0, 0, 1, 2]
    assert long.num_output_tokens == 2
    assert all(sum(s.scheduled.values()) <= 8 for s in steps)


def test_max_num_seqs_caps_the_running_batch() -> None:
    e = engine(max_num_seqs=2)
    for i in range(3):
        e.add_request(f"r{i}", prompt(4, 1000 * (i + 1)), max_tokens=2, now=0.0)
    first = e.step(0.0)
    assert set(first.scheduled) == {"r0", "r1"}
    assert [r.request_id for r in e.waiting] == ["r2"]
    e.step(0.0)  # r0 and r1 sample their second token and finish
    assert e.step(0.0).scheduled == {"r2": 4}


def test_waiting_head_that_does_not_fit_blocks_those_behind_it() -> None:
    e = engine(num_gpu_blocks=7, max_model_len=24)  # 6 usable blocks
    e.add_request("big", prompt(16), max_tokens=2, now=0.0)
    e.step(0.0)  # big holds 4 blocks
    e.add_request("head", prompt(8, 2000), max_tokens=2, now=0.0)  # needs 2 blocks
    e.add_request("small", prompt(4, 3000), max_tokens=2, now=0.0)  # needs 1 block
    result = e.step(0.0)  # big's decode takes its 5th block: 1 left
    assert result.scheduled == {"big": 1}
    assert [r.request_id for r in e.waiting] == ["head", "small"]
    assert e.pool.num_free_blocks == 6  # big sampled its last token and freed its blocks
    assert e.step(0.0).scheduled == {"head": 8, "small": 4}


def test_preemption_takes_the_most_recently_admitted_request_and_requeues_it_first() -> None:
    e = engine(num_gpu_blocks=7, max_model_len=24)  # 6 usable blocks of 4 tokens
    requests = [e.add_request(f"r{i}", prompt(4, 1000 * (i + 1)), 12, now=0.0) for i in range(3)]
    for _ in range(5):  # each computes 8 tokens: 2 blocks each, the pool is full
        assert not e.step(0.0).preempted
    assert e.pool.num_free_blocks == 0
    late = e.add_request("late", prompt(4, 9000), 4, now=0.0)
    result = e.step(0.0)  # r0 needs a 3rd block for its 9th token
    assert result.preempted == ["r2"]
    assert result.scheduled == {"r0": 1, "r1": 1}
    victim = requests[2]
    assert victim.status is Status.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim.blocks == []
    assert victim.num_output_tokens == 5  # its output survives; it is recomputed later
    assert [r.request_id for r in e.waiting] == ["r2", "late"]  # front of the queue
    assert late.status is Status.WAITING  # no admission in a step that preempted
    assert e.stats.num_preemptions == 1
    e.add_request("x", prompt(4, 7000), 1, now=0.0)
    run_to_completion(e)
    assert victim.finish_reason is FinishReason.LENGTH
    assert victim.num_output_tokens == 12


def test_a_request_preempts_itself_when_it_is_the_last_one_running() -> None:
    e = engine(num_gpu_blocks=7, max_model_len=24)
    a = e.add_request("a", prompt(12), 12, now=0.0)  # 3 blocks
    b = e.add_request("b", prompt(12, 2000), 12, now=0.0)  # 3 blocks
    e.step(0.0)
    result = e.step(0.0)  # a needs its 4th block: b is preempted; a gets it
    assert result.preempted == ["b"]
    assert a.status is Status.RUNNING and b.status is Status.PREEMPTED
    run_to_completion(e)
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH


def test_identical_prompts_reuse_full_cached_blocks() -> None:
    e = engine()
    e.add_request("first", prompt(10), max_tokens=1, now=0.0)
    run_to_completion(e)
    second = e.add_request("second", prompt(10), max_tokens=1, now=0.0)
    result = e.step(0.0)
    assert second.num_cached_tokens == 8  # two full blocks; the partial third is computed
    assert result.scheduled == {"second": 2}
    assert (e.stats.prefix_cache_queries, e.stats.prefix_cache_hits) == (20, 8)


def test_a_prompt_of_whole_blocks_still_computes_its_last_token() -> None:
    e = engine()
    e.add_request("first", prompt(8), max_tokens=1, now=0.0)
    run_to_completion(e)
    second = e.add_request("second", prompt(8), max_tokens=1, now=0.0)
    assert e.step(0.0).scheduled == {"second": 4}
    assert second.num_cached_tokens == 4


def test_a_prompt_differing_in_one_token_hits_only_the_blocks_before_it() -> None:
    e = engine()
    e.add_request("first", prompt(16), max_tokens=1, now=0.0)
    run_to_completion(e)
    changed = prompt(16)
    changed[9] = 1  # inside the third block
    other = e.add_request("other", changed, max_tokens=1, now=0.0)
    e.step(0.0)
    assert other.num_cached_tokens == 8
    first_token_changed = [7, *prompt(15, 1001)]
    miss = e.add_request("miss", first_token_changed, max_tokens=1, now=0.0)
    e.step(0.0)
    assert miss.num_cached_tokens == 0
    assert e.stats.prefix_cache_hits == 8
    assert e.stats.prefix_cache_queries == 48


def test_requests_computing_the_same_prefix_in_one_step_share_it() -> None:
    e = engine()
    for i in range(3):
        e.add_request(f"r{i}", prompt(10), max_tokens=1, now=0.0)
    result = e.step(0.0)
    # Blocks are cached when allocated, so later requests in the same step hit them.
    assert result.scheduled == {"r0": 10, "r1": 2, "r2": 2}
    assert e.stats.prefix_cache_hits == 16


def test_eviction_reuses_uncached_blocks_first_then_least_recently_freed_chain_tails() -> None:
    e = engine(num_gpu_blocks=7, max_model_len=24)  # blocks 1..6
    e.add_request("a", prompt(8), max_tokens=1, now=0.0)  # blocks 1, 2
    run_to_completion(e)
    assert e.pool.free_block_ids() == [3, 4, 5, 6, 2, 1]  # a's blocks freed tail first
    b = e.add_request("b", prompt(12, 5000), max_tokens=2, now=0.0)
    e.step(0.0)
    e.step(0.0)  # its decode takes a 4th block, 6, which never fills and has no hash
    assert [block.block_id for block in b.blocks] == []  # finished, freed
    # as vLLM's BlockPool.free_blocks: the hashless block goes to the head, to be reused
    # first; the cached ones join the tail, tail first
    assert e.pool.free_block_ids() == [6, 2, 1, 5, 4, 3]
    e.add_request("c", prompt(8, 6000), max_tokens=1, now=0.0)
    e.step(0.0)  # c takes two blocks from the head: 6, then a's tail (2), evicting its hash
    assert e.pool.evictions == 1
    assert e.pool.free_block_ids() == [1, 5, 4, 3, 2, 6]
    again = e.add_request("again", prompt(8), max_tokens=1, now=0.0)
    e.step(0.0)
    assert again.num_cached_tokens == 4  # a's first block survived
    assert e.pool.evictions == 2  # its second block came from the head: 5, b's last


def test_prompt_plus_max_tokens_above_max_model_len_is_rejected() -> None:
    e = engine()
    with pytest.raises(ContextLengthError) as info:
        e.add_request("r", prompt(50), max_tokens=20, now=0.0)
    assert str(info.value) == (
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
        "(50 in the messages, 20 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    with pytest.raises(ContextLengthError, match="maximum context length is 64 tokens"):
        e.add_request("r", prompt(64), max_tokens=None, now=0.0)
    assert e.add_request("ok", prompt(50), max_tokens=None, now=0.0).max_tokens == 14
    assert [r.request_id for r in e.waiting] == ["ok"]


def test_aborting_a_running_request_frees_its_blocks() -> None:
    e = engine()
    request = e.add_request("r", prompt(30), max_tokens=20, now=0.0)
    e.step(0.0)
    assert e.pool.num_free_blocks == 64 - 8
    e.abort("r", now=1.0)
    assert e.pool.num_free_blocks == 64
    assert request.finish_reason is FinishReason.ABORT
    assert not e.has_unfinished_requests()
    assert e.abort("r", now=1.0) is None


def test_step_cost_counts_overhead_prefill_tokens_and_decoding_sequences() -> None:
    e = engine(step_overhead_s=0.006, prefill_token_s=0.0001, decode_seq_s=0.001)
    e.add_request("a", prompt(40), max_tokens=3, now=0.0)
    first = e.step(0.0)
    assert (first.num_prefill_tokens, first.num_decode_seqs) == (40, 0)
    assert first.cost_s == pytest.approx(0.006 + 40 * 0.0001)
    e.add_request("b", prompt(20, 3000), max_tokens=3, now=first.end_time)
    second = e.step(first.end_time)
    assert (second.num_prefill_tokens, second.num_decode_seqs) == (20, 1)
    assert second.cost_s == pytest.approx(0.006 + 20 * 0.0001 + 0.001)


def test_timestamps_follow_the_simulated_clock() -> None:
    e = engine(step_overhead_s=0.01, prefill_token_s=0.0, decode_seq_s=0.0)
    request = e.add_request("r", prompt(4), max_tokens=3, now=5.0)
    end = run_to_completion(e, now=6.0)
    assert request.first_scheduled_time == 6.0
    assert request.first_token_time == pytest.approx(6.01)
    assert request.finished_time == pytest.approx(end) == pytest.approx(6.03)


def test_output_lengths_are_seeded_capped_and_end_with_stop() -> None:
    def lengths(seed: int) -> list[int]:
        e = engine(output_len_dist="lognormal", seed=seed)
        return [e.add_request(f"r{i}", prompt(4), 40, 0.0).output_len for i in range(20)]

    assert lengths(3) == lengths(3)
    assert lengths(3) != lengths(4)
    assert all(1 <= n <= 40 for n in lengths(3))
    assert any(n < 40 for n in lengths(3))
    e = engine(output_len_dist="uniform", output_len_min_fraction=0.5, seed=1)
    short = e.add_request("s", prompt(4), 40, 0.0)
    forced = e.add_request("f", prompt(4, 2000), 40, 0.0, ignore_eos=True)
    run_to_completion(e)
    assert 20 <= short.num_output_tokens < 40 and short.finish_reason is FinishReason.STOP
    assert forced.num_output_tokens == 40 and forced.finish_reason is FinishReason.LENGTH


def test_prompt_and_generation_token_counters_count_each_request_once() -> None:
    e = engine(num_gpu_blocks=7, max_model_len=24)
    for i in range(3):
        e.add_request(f"r{i}", prompt(4, 1000 * (i + 1)), 12, now=0.0)
    run_to_completion(e)
    assert e.stats.num_preemptions > 0
    assert e.stats.prompt_tokens == 12  # recomputation after preemption is not recounted
    assert e.stats.generation_tokens == 36
    assert e.stats.finished == 3


def test_a_waiting_request_starts_only_when_its_whole_prompt_fits_not_its_first_chunk() -> None:
    # 16 usable blocks of 4 tokens; chunks of 8 tokens. "long" needs 12 blocks for its prompt.
    e = engine(num_gpu_blocks=17, max_num_batched_tokens=8)
    e.add_request("holder", prompt(24, 5000), max_tokens=8, now=0.0)  # 6 blocks, then more
    for _ in range(3):
        e.step(0.0)
    e.add_request("long", prompt(48), max_tokens=1, now=0.0)
    e.step(0.0)
    # 10 blocks free, its first chunk would fit in 2: vLLM (scheduler_reserve_full_isl) waits
    assert [r.request_id for r in e.waiting] == ["long"]
    run_to_completion(e)
    assert e.stats.num_preemptions == 0
    first_chunk_only = engine(num_gpu_blocks=17, max_num_batched_tokens=8, reserve_full_prompt=False)
    first_chunk_only.add_request("holder", prompt(24, 5000), max_tokens=8, now=0.0)
    for _ in range(3):
        first_chunk_only.step(0.0)
    first_chunk_only.add_request("long", prompt(48), max_tokens=1, now=0.0)
    first_chunk_only.step(0.0)
    assert [r.request_id for r in first_chunk_only.running] == ["holder", "long"]


def test_prefix_cache_counters_count_a_request_once_when_it_is_first_admitted() -> None:
    e = engine(num_gpu_blocks=9, max_model_len=32)  # 8 usable blocks
    e.add_request("big", prompt(28), max_tokens=4, now=0.0)  # 7 blocks for its prompt
    e.step(0.0)
    e.add_request("waits", prompt(12, 5000), max_tokens=1, now=0.0)
    for _ in range(3):
        e.step(0.0)  # "waits" is looked up and refused each step: no query is counted
    assert e.stats.prefix_cache_queries == 28
    run_to_completion(e)
    assert e.stats.prefix_cache_queries == 28 + 12


def test_priority_policy_orders_the_queue_by_priority_then_arrival() -> None:
    e = engine(scheduling_policy="priority", max_num_seqs=1)
    e.add_request("running", prompt(4), max_tokens=50, now=0.0)
    e.step(0.0)
    e.add_request("low", prompt(4, 2000), max_tokens=1, now=1.0, priority=5)
    e.add_request("high_late", prompt(4, 3000), max_tokens=1, now=3.0, priority=0)
    e.add_request("high_early", prompt(4, 4000), max_tokens=1, now=2.0, priority=0)
    assert [r.request_id for r in e.waiting] == ["high_early", "high_late", "low"]


def test_priority_policy_preempts_the_lowest_priority_running_request_not_the_newest() -> None:
    e = engine(scheduling_policy="priority", num_gpu_blocks=7, max_model_len=24)  # 6 blocks
    e.add_request("low", prompt(7), max_tokens=12, now=0.0, priority=3)
    e.add_request("high", prompt(7, 2000), max_tokens=12, now=1.0, priority=0)
    preempted: list[str] = []
    for _ in range(12):
        preempted += e.step(0.0).preempted
    assert preempted and set(preempted) == {"low"}  # fcfs would have taken "high", the newest


def test_a_non_zero_priority_is_refused_under_fcfs_as_vllm_refuses_it() -> None:
    with pytest.raises(ValueError, match="priority"):
        engine().add_request("r", prompt(4), max_tokens=1, now=0.0, priority=1)


def test_an_explicit_output_length_stops_the_request_there() -> None:
    e = engine()
    request = e.add_request("r", prompt(4), max_tokens=20, now=0.0, output_len=7)
    run_to_completion(e)
    assert request.num_output_tokens == 7
    assert request.finish_reason is FinishReason.STOP
