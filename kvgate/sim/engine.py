"""The simulated vLLM V1 engine: continuous batching over a paged KV pool, one step at a time.

Pure: no I/O, no clock of its own (callers pass the simulated time), deterministic for a seed.
A step does what vLLM V1's `Scheduler.schedule()` and `update_from_output()` do:

1. Every running request, in order, gets its next tokens (a decode token or the next prefill
   chunk) within the step's token budget. Blocks are allocated for the tokens computed now,
   never reserved for max_tokens. When none is free, the most recently admitted running
   request is preempted (blocks freed, computed tokens reset, back to the *front* of the
   waiting queue, recomputed later) until the allocation succeeds.
2. Only if nothing was preempted, waiting requests are admitted in order while the budget,
   `max_num_seqs` and blocks last; a head that does not fit blocks those behind it. A request
   first looks up its longest chain of cached prefix blocks (capped so one prompt token is
   computed); it starts only if blocks for its whole prompt are free (vLLM's
   `scheduler_reserve_full_isl`), though it is given blocks for this step's chunk only.
3. Each request whose computed tokens caught up with its tokens samples one output token; it
   finishes at its drawn output length (`stop`) or at max_tokens (`length`), freeing its
   blocks tail first.

The step's simulated cost is `step_overhead_s + prefill_tokens * prefill_token_s +
decode_seqs * decode_seq_s`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from kvgate.sim.blocks import Block, BlockPool
from kvgate.sim.config import SimConfig
from kvgate.sim.reports import EngineStats, StepResult, TokenOutput
from kvgate.sim.request import (
    FinishReason,
    SimRequest,
    Status,
    check_context_length,
    draw_output_len,
)
from kvgate.sim.text import FILLER_TOKEN_IDS
from kvgate.sim.waiting import WaitingQueue


class Engine:
    def __init__(
        self, config: SimConfig, filler_token_ids: Sequence[int] = FILLER_TOKEN_IDS
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_gpu_blocks, config.enable_prefix_caching,
                              events=config.kv_events is not None)
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.stats = EngineStats()
        # told of each request as it finishes (a test's or a tool's observer)
        self.on_finish: Callable[[SimRequest], None] | None = None
        self._rng = random.Random(config.seed)
        self._filler = tuple(filler_token_ids)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int | None,
        now: float,
        *,
        ignore_eos: bool = False,
        output_len: int | None = None,
        priority: int = 0,
    ) -> SimRequest:
        """Queue a request. Raises ContextLengthError as vLLM's 400; ValueError on a reused id.

        `output_len`: the tokens it writes before its end-of-sequence (default: drawn from the
        configured distribution, or max_tokens with `ignore_eos`). `priority`: lower runs first
        under the priority policy; non-zero is refused under fcfs, as vLLM refuses it.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        cfg = self.config
        max_tokens = check_context_length(len(prompt_token_ids), max_tokens, cfg.max_model_len)
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if priority and cfg.scheduling_policy != "priority":
            raise ValueError("priority: non-zero priority needs scheduling_policy priority")
        if ignore_eos:
            output_len = max_tokens
        elif output_len is None:
            output_len = draw_output_len(
                self._rng,
                max_tokens,
                cfg.output_len_dist,
                min_fraction=cfg.output_len_min_fraction,
                median_fraction=cfg.output_len_median_fraction,
                sigma=cfg.output_len_sigma,
            )
        request = SimRequest(
            request_id, prompt_token_ids, max_tokens, output_len, now, self.block_size, priority
        )
        self.requests[request_id] = request
        self.waiting.append(request)
        return request

    def abort(self, request_id: str, now: float) -> SimRequest | None:
        """Remove an unfinished request and free its blocks (a client went away)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is Status.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._free(request)
        request.status = Status.FINISHED
        request.finish_reason = FinishReason.ABORT
        request.finished_time = now
        self.stats.aborted += 1
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step

    def step(self, now: float) -> StepResult:
        scheduled, preempted = self._schedule(now)
        cfg = self.config
        prefill_tokens = decode_seqs = 0
        for request, n in scheduled.items():
            if n == 1 and request.num_output_tokens and request.num_computed_tokens + 1 == (
                request.num_tokens
            ):
                decode_seqs += 1
            else:
                prefill_tokens += n
        if not scheduled:
            return StepResult(now, 0.0, {}, 0, 0, [], preempted, [])
        cost = (
            cfg.step_overhead_s
            + prefill_tokens * cfg.prefill_token_s
            + decode_seqs * cfg.decode_seq_s
        )
        end = now + cost
        outputs: list[TokenOutput] = []
        finished: list[SimRequest] = []
        for request, n in scheduled.items():
            request.num_computed_tokens += n
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk; no token yet
            output = self._sample(request, end)
            outputs.append(output)
            if output.finish_reason is not None:
                self._finish(request, output.finish_reason, end)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        self.stats.steps += 1
        return StepResult(
            now,
            cost,
            {request.request_id: n for request, n in scheduled.items()},
            prefill_tokens,
            decode_seqs,
            outputs,
            preempted,
            finished,
        )

    def _schedule(self, now: float) -> tuple[dict[SimRequest, int], list[str]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[SimRequest, int] = {}
        preempted: list[str] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n <= 0:
                index += 1
                continue
            placed = True
            while not self._allocate(request, n, [], 0):
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < index:
                    index -= 1
                budget += scheduled.pop(victim, 0)  # priority: an earlier one, unscheduled
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    placed = False
                    break
            if not placed:
                if cfg.scheduling_policy == "priority":
                    continue  # the requests after it rank higher and may still fit
                break
            scheduled[request] = n
            budget -= n
            index += 1
        if preempted:
            return scheduled, preempted
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting.peek()
            hits, num_hit_tokens = self._lookup(request)
            n = min(request.num_tokens - num_hit_tokens, budget)
            if cfg.reserve_full_prompt and not self._whole_prompt_fits(request, hits):
                break
            if not self._allocate(request, n, hits, num_hit_tokens):
                break
            self.waiting.pop()
            if request.num_preemptions == 0:  # vLLM counts a request's first admission only
                self.stats.prefix_cache_queries += request.num_tokens
                self.stats.prefix_cache_hits += num_hit_tokens
            self.running.append(request)
            request.status = Status.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            scheduled[request] = n
            budget -= n
        return scheduled, preempted

    def _victim(self) -> SimRequest:
        """Who is preempted when blocks run out: the newest running request under fcfs, the
        largest (priority, arrival_time) under priority."""
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    # ------------------------------------------------------------------ KV management

    def _lookup(self, request: SimRequest) -> tuple[list[Block], int]:
        """The longest chain of cached blocks for a request's tokens (counted on admission)."""
        if not self.pool.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _whole_prompt_fits(self, request: SimRequest, hits: list[Block]) -> bool:
        """vLLM's admission gate (`scheduler_reserve_full_isl`, on by default): a waiting
        request starts only if blocks for all its tokens are free now, not only for its first
        chunk; cached hits nobody holds count against the free blocks they leave."""
        tokens = min(request.num_tokens, self.config.max_model_len)
        needed = -(-tokens // self.block_size) - len(request.blocks) - len(hits)
        evictable_hits = sum(1 for block in hits if block.ref_cnt == 0)
        return max(needed, 0) + evictable_hits <= self.pool.num_free_blocks

    def _allocate(
        self, request: SimRequest, n: int, hits: list[Block], num_hit_tokens: int
    ) -> bool:
        """Blocks for `n` more tokens (after the prefix hits); False when they do not fit."""
        bs = self.block_size
        computed = request.num_computed_tokens + num_hit_tokens
        needed = -(-(computed + n) // bs)
        num_new = needed - len(request.blocks) - len(hits)
        evictable_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new + evictable_hits > self.pool.num_free_blocks:
            return False
        if hits:
            self.pool.touch(hits)
            request.blocks.extend(hits)
        if num_new > 0:
            request.blocks.extend(self.pool.allocate(num_new))
        num_full = min(computed + n, request.num_tokens) // bs
        self.pool.cache_full(request.blocks, request.block_hashes, request.token_ids,
                             request.num_cached_blocks, num_full, bs)
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)
        return True

    def _free(self, request: SimRequest) -> None:
        self.pool.free(reversed(request.blocks))
        request.blocks = []
        request.num_cached_blocks = 0

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.num_computed_tokens = 0
        request.status = Status.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(request)

    # ------------------------------------------------------------------ outputs

    def _sample(self, request: SimRequest, end: float) -> TokenOutput:
        index = request.num_output_tokens
        request.append_output(self._filler[index % len(self._filler)], self.block_size)
        self.stats.generation_tokens += 1
        if index == 0:
            self.stats.prompt_tokens += request.num_prompt_tokens
            request.first_token_time = end
        inter_token = None if request.last_token_time is None else end - request.last_token_time
        request.last_token_time = end
        reason: FinishReason | None = None
        if request.num_output_tokens >= request.output_len:
            reason = (
                FinishReason.STOP if request.output_len < request.max_tokens else FinishReason.LENGTH
            )
        elif request.num_tokens >= self.config.max_model_len:
            reason = FinishReason.LENGTH
        return TokenOutput(request, index, reason, inter_token)

    def _finish(self, request: SimRequest, reason: FinishReason, end: float) -> None:
        self._free(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.finished_time = end
        del self.requests[request.request_id]
        self.stats.finished += 1
        if self.on_finish is not None:
            self.on_finish(request)

    # ------------------------------------------------------------------ inspection

    def state(self, *, with_requests: bool = False) -> dict[str, Any]:
        """The live state `/sim/state` reports."""
        pool = self.pool
        state: dict[str, Any] = {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "num_gpu_blocks": pool.num_gpu_blocks,
            "block_size": self.block_size,
            "free_blocks": pool.num_free_blocks,
            "held_blocks": pool.num_gpu_blocks - 1 - pool.num_free_blocks,
            "cached_blocks": pool.num_cached_blocks,
            "kv_cache_usage_perc": pool.usage(),
            "preemptions": self.stats.num_preemptions,
            "prefix_cache_queries": self.stats.prefix_cache_queries,
            "prefix_cache_hits": self.stats.prefix_cache_hits,
            "prompt_tokens": self.stats.prompt_tokens,
            "generation_tokens": self.stats.generation_tokens,
            "finished": self.stats.finished,
            "aborted": self.stats.aborted,
            "steps": self.stats.steps,
            "evictions": pool.evictions,
        }
        if with_requests:
            state["requests"] = [
                {
                    "id": r.request_id,
                    "status": r.status.value,
                    "prompt_tokens": r.num_prompt_tokens,
                    "output_tokens": r.num_output_tokens,
                    "max_tokens": r.max_tokens,
                    "computed_tokens": r.num_computed_tokens,
                    "cached_tokens": max(0, r.num_cached_tokens),
                    "blocks": len(r.blocks),
                    "preemptions": r.num_preemptions,
                }
                for r in (*self.running, *self.waiting)
            ]
        return state
