"""The two engines behind one interface: add a request, abort one, step, and say what happened.

`VllmSide` drives vLLM's real `Scheduler` as vLLM's own scheduler tests do: `schedule()`, then a
`ModelRunnerOutput` with one sampled token for every request whose prompt is fully computed,
then `update_from_output()`. `SimSide` drives kvgate's `kvgate.sim.engine.Engine`. Both sample
the same token ids (the simulator's filler tokens), so blocks holding output tokens hash alike,
and both stop a request with its end-of-sequence after `stop_after` tokens.

Each step returns a `StepView`: the facts compared, nothing engine-specific.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from conformance.shape import EngineShape
from conformance.traces import TraceRequest
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.text import FILLER_TOKEN_IDS

EOS_TOKEN_ID = 2
assert EOS_TOKEN_ID not in FILLER_TOKEN_IDS


def child_ids(request: TraceRequest) -> list[str]:
    """Engine request ids, as vLLM's frontend names the children of a parallel-sampling request."""
    if request.n == 1:
        return [request.id]
    return [f"{j}_{request.id}" for j in range(request.n)]


@dataclass(frozen=True)
class StepView:
    running: int
    waiting: int
    blocks_in_use: int  # held by some request; the null block and cached free blocks excluded
    scheduled: Mapping[str, int]  # tokens computed this step, per request
    preempted: tuple[str, ...]  # in the order the scheduler chose them
    finished: tuple[tuple[str, str], ...]  # (id, reason) in the order they finished
    query_tokens: int  # cumulative, as vllm:prefix_cache_queries
    hit_tokens: int  # cumulative, as vllm:prefix_cache_hits
    computed: Mapping[str, int]  # each unfinished request's computed tokens
    cached: Mapping[str, int]  # prompt tokens found in the prefix cache at first scheduling
    free_queue: tuple[int, ...]  # free block ids, next to be reused first (eviction order)
    # the step's KV cache events, each block named by its content (ChainKeys), not its hash
    kv_events: tuple[tuple[object, ...], ...] = ()


class ChainKeys:
    """Names each block an engine's KV events mention by what it holds: its tokens, chained
    from its parent's, as a subscriber recomputes them (the engines' hashes differ: vLLM's
    are sha256 of its own encoding, the simulator's Python's hash)."""

    ROOT = 0

    def __init__(self) -> None:
        self._keys: dict[object, int] = {}

    def view(self, events: Any) -> tuple[tuple[object, ...], ...]:
        """Events (vLLM's classes or the simulator's: the same fields) as
        ("stored", keys...), ("removed", keys...) or ("cleared",)."""
        out: list[tuple[object, ...]] = []
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                parent = self.ROOT if event.parent_block_hash is None else self._keys[
                    event.parent_block_hash]
                size, keys = event.block_size, []
                for i, block_hash in enumerate(event.block_hashes):
                    parent = hash((parent, tuple(event.token_ids[i * size : (i + 1) * size])))
                    self._keys[block_hash] = parent
                    keys.append(parent)
                out.append(("stored", *keys))
            elif kind == "BlockRemoved":
                out.append(("removed", *(self._keys.get(h) for h in event.block_hashes)))
            else:
                out.append(("cleared",))
        return tuple(out)


class Side(Protocol):
    name: str

    def add(self, request: TraceRequest, step: int) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> StepView: ...

    def idle(self) -> bool: ...


def _token(index: int, stop_after: int | None) -> int:
    """The token a request writes at output position `index` (0-based)."""
    if stop_after is not None and index + 1 == stop_after:
        return EOS_TOKEN_ID
    return FILLER_TOKEN_IDS[index % len(FILLER_TOKEN_IDS)]


class SimSide:
    name = "kvgate-sim"

    def __init__(self, shape: EngineShape) -> None:
        self.engine = Engine(
            SimConfig(
                num_gpu_blocks=shape.num_gpu_blocks,
                block_size=shape.block_size,
                max_model_len=shape.max_model_len,
                max_num_seqs=shape.max_num_seqs,
                max_num_batched_tokens=shape.max_num_batched_tokens,
                enable_prefix_caching=shape.enable_prefix_caching,
                scheduling_policy=shape.policy,
                kv_events_config='{"enable_kv_cache_events": true}',  # recorded, not published
            )
        )
        self._now = 0.0
        self._keys = ChainKeys()

    def add(self, request: TraceRequest, step: int) -> None:
        for child in child_ids(request):
            self.engine.add_request(
                child, request.prompt, request.max_tokens, float(step),
                output_len=request.stop_after, priority=request.priority,
            )  # fmt: skip

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id, self._now)

    def step(self) -> StepView:
        engine = self.engine
        result = engine.step(self._now)
        self._now = result.end_time
        pool, stats = engine.pool, engine.stats
        live = (*engine.running, *engine.waiting)
        return StepView(
            running=len(engine.running),
            waiting=len(engine.waiting),
            blocks_in_use=pool.num_gpu_blocks - 1 - pool.num_free_blocks,
            scheduled=dict(result.scheduled),
            preempted=tuple(result.preempted),
            finished=tuple(
                (r.request_id, r.finish_reason.value if r.finish_reason else "?")
                for r in result.finished
            ),
            query_tokens=stats.prefix_cache_queries,
            hit_tokens=stats.prefix_cache_hits,
            computed={r.request_id: r.num_computed_tokens for r in live},
            cached={r.request_id: r.num_cached_tokens for r in live if r.num_cached_tokens >= 0},
            free_queue=tuple(pool.free_block_ids()),
            kv_events=self._keys.view(pool.take_events()),
        )

    def idle(self) -> bool:
        return not self.engine.has_unfinished_requests()


class VllmSide:
    name = "vllm"

    def __init__(self, shape: EngineShape) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        from conformance.vllm_setup import build_scheduler

        init_none_hash(sha256)
        self.shape = shape
        self.scheduler = build_scheduler(shape)
        self._hasher = get_request_block_hasher(shape.block_size, sha256)
        self._sampling = SamplingParams
        self._stop: dict[str, int | None] = {}
        self._queries = self._hits = 0
        self._cached: dict[str, int] = {}
        self._keys = ChainKeys()
        self._published: list[Any] = []  # the batches vLLM's scheduler published, in order
        self.scheduler.kv_event_publisher = _Capture(self._published)

    def _kv_events(self) -> tuple[tuple[object, ...], ...]:
        batches, self._published[:] = list(self._published), []
        return self._keys.view([event for batch in batches for event in batch.events])

    def add(self, request: TraceRequest, step: int) -> None:
        from vllm.v1.request import Request

        for child in child_ids(request):
            params = self._sampling(max_tokens=request.max_tokens)
            params.update_from_generation_config({}, EOS_TOKEN_ID)
            self._stop[child] = request.stop_after
            self.scheduler.add_request(
                Request(
                    request_id=child,
                    prompt_token_ids=list(request.prompt),
                    sampling_params=params,
                    pooling_params=None,
                    arrival_time=float(step),
                    priority=request.priority,
                    block_hasher=self._hasher,
                )
            )

    def _update(self, output: Any, runner: Any) -> list[tuple[str, str]]:
        """`update_from_output`; the requests it finished, and the step's prefix-cache stats
        counted as the engine core hands them to the Prometheus logger."""
        finished: list[tuple[str, str]] = []
        for outputs in self.scheduler.update_from_output(output, runner).values():
            for item in outputs.outputs:
                if item.finish_reason is not None:
                    finished.append((item.request_id, str(item.finish_reason)))
            stats = outputs.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                self._queries += stats.prefix_cache_stats.queries
                self._hits += stats.prefix_cache_stats.hits
        return finished

    def abort(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def step(self) -> StepView:
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        before = {rid: r.num_preemptions for rid, r in scheduler.requests.items()}
        output = scheduler.schedule()
        for new in output.scheduled_new_reqs:  # their prefill stats go with the first token
            stats_of = scheduler.requests[new.req_id].prefill_stats
            if stats_of is not None and new.req_id not in self._cached:
                self._cached[new.req_id] = stats_of.num_local_cached_tokens
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            request = scheduler.requests[rid]
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])  # a prefill chunk: the model runner returns no token
            else:
                sampled.append([_token(request.num_output_tokens, self._stop[rid])])
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        finished = self._update(output, runner)
        preempted = [
            rid for rid in (output.preempted_req_ids or ())
        ] or [
            rid for rid, r in scheduler.requests.items()
            if r.num_preemptions > before.get(rid, 0)
        ]  # fmt: skip
        running, waiting = scheduler.get_request_counts()
        pool = scheduler.kv_cache_manager.block_pool
        requests = scheduler.requests
        return StepView(
            running=running,
            waiting=waiting,
            blocks_in_use=self.shape.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
            scheduled=dict(output.num_scheduled_tokens),
            preempted=tuple(preempted),
            finished=tuple(finished),
            query_tokens=self._queries,
            hit_tokens=self._hits,
            computed={rid: r.num_computed_tokens for rid, r in requests.items()},
            cached={rid: self._cached[rid] for rid in requests if rid in self._cached},
            free_queue=tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
            kv_events=self._kv_events(),
        )  # fmt: skip

    def idle(self) -> bool:
        return not self.scheduler.has_requests()


class _Capture:
    """Stands in for vLLM's event publisher: keeps the batches its scheduler publishes."""

    def __init__(self, into: list[Any]) -> None:
        self.into = into

    def publish(self, batch: Any) -> None:
        self.into.append(batch)

    def shutdown(self) -> None:
        pass


class AsyncVllmSide(VllmSide):
    """vLLM's `AsyncScheduler` as `EngineCore.step_with_batch_queue` drives it (vLLM's
    default on GPUs): two batches in flight, so step k+1 is scheduled before step k's tokens
    are known, with a placeholder token per decoding request. One `step()` is one iteration
    of that loop: schedule if it can, and take the oldest batch's output when the queue is
    full or nothing more can be scheduled."""

    name = "vllm-async"
    QUEUE = 2  # VllmConfig.max_concurrent_batches with async scheduling

    def __init__(self, shape: EngineShape) -> None:
        from collections import deque

        from conformance.vllm_setup import build_scheduler

        super().__init__(shape)
        self.scheduler = build_scheduler(shape, asynchronous=True)
        self._queue: deque = deque()
        self.batches = 0

    def step(self) -> StepView:
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        before = {rid: r.num_preemptions for rid, r in scheduler.requests.items()}
        scheduled: dict[str, int] = {}
        finished: list[tuple[str, str]] = []
        done = False
        if scheduler.has_requests():
            output = scheduler.schedule()
            scheduled = dict(output.num_scheduled_tokens)
            if output.total_num_scheduled_tokens:
                self.batches += 1
            samples = {  # the output position each sampling request writes in this batch
                rid: scheduler.requests[rid].num_computed_tokens
                - scheduler.requests[rid].num_prompt_tokens
                for rid in output.num_scheduled_tokens
                if not scheduler.requests[rid].is_prefill_chunk
            }
            self._queue.appendleft((output, samples))
            if len(self._queue) < self.QUEUE and (
                output.total_num_scheduled_tokens or scheduler.has_requests()
            ):
                done = True
        elif not self._queue:
            done = True
        if not done:
            output, samples = self._queue.pop()
            req_ids = list(output.num_scheduled_tokens)
            runner = ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                sampled_token_ids=[
                    [_token(samples[rid], self._stop[rid])] if rid in samples else []
                    for rid in req_ids
                ],
            )
            finished = self._update(output, runner)
        running, waiting = scheduler.get_request_counts()
        pool = scheduler.kv_cache_manager.block_pool
        return StepView(
            running=running,
            waiting=waiting,
            blocks_in_use=self.shape.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
            scheduled=scheduled,
            preempted=tuple(
                rid for rid, r in scheduler.requests.items()
                if r.num_preemptions > before.get(rid, 0)
            ),
            finished=tuple(finished),
            query_tokens=self._queries,
            hit_tokens=self._hits,
            computed={},
            cached={},
            free_queue=(),
        )  # fmt: skip

    def idle(self) -> bool:
        return not self.scheduler.has_requests() and not self._queue
