"""One engine's life inside a server: the step loop, the simulated clock, token delivery.

The step loop is an asyncio task. It sleeps on an event while nothing is queued (no busy
loop); otherwise it runs one engine step, sleeps the step's simulated cost × `time_scale`
(minus the time the step itself took), then hands each sampled token to the `Generation`
its HTTP handler awaits.

Simulated time advances by step costs while the engine is busy and with wall time / scale
while it is idle, so a small `time_scale` compresses a minute of load into seconds without
Python's own overhead inflating the simulated latencies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from kvgate.sim.admission import AdmissionRejected, rejection
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.kv_events import Publisher
from kvgate.sim.metrics import SimMetrics
from kvgate.sim.reports import StepResult
from kvgate.sim.request import FinishReason, SimRequest


class SimClock:
    """Simulated seconds since the engine started."""

    def __init__(self, time_scale: float, wall: Callable[[], float] = time.monotonic) -> None:
        self.time_scale = time_scale
        self._wall = wall
        self._virtual = 0.0
        self._idle_since: float | None = wall()

    def now(self) -> float:
        if self._idle_since is not None and self.time_scale > 0:
            return self._virtual + (self._wall() - self._idle_since) / self.time_scale
        return self._virtual

    def idle(self) -> None:
        self._virtual = self.now()
        self._idle_since = self._wall()

    def busy(self) -> None:
        self._virtual = self.now()
        self._idle_since = None

    def advance(self, seconds: float) -> None:
        self._virtual += seconds


class Generation:
    """What an HTTP handler awaits: how many output tokens are ready, and how it ended."""

    __slots__ = ("_waiter", "finish_reason", "num_ready", "request")

    def __init__(self, request: SimRequest) -> None:
        self.request = request
        self.num_ready = 0
        self.finish_reason: FinishReason | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def wait_beyond(self, seen: int) -> None:
        """Return once more than `seen` tokens are ready or the generation ended."""
        while self.num_ready <= seen and self.finish_reason is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def wait_finished(self) -> None:
        while self.finish_reason is None:
            await self.wait_beyond(self.num_ready)

    def _update(self, num_ready: int, finish_reason: FinishReason | None) -> None:
        self.num_ready = num_ready
        if finish_reason is not None:
            self.finish_reason = finish_reason
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


async def wait_any(progress: Sequence[tuple[Generation, int]]) -> None:
    """Return once any generation has more tokens ready than its seen count, or ended.

    One future is shared as every generation's waiter: the first update completes it, and
    the others find it done (the n choices of a request wait together, as one handler).
    """
    while not any(g.num_ready > seen or g.finish_reason is not None for g, seen in progress):
        waiter = asyncio.get_running_loop().create_future()
        for generation, _ in progress:
            generation._waiter = waiter
        try:
            await waiter
        finally:
            for generation, _ in progress:
                generation._waiter = None


class EngineRuntime:
    """An engine, its metrics and its step loop; a restart replaces the whole runtime."""

    def __init__(self, config: SimConfig, filler_token_ids: Sequence[int] | None = None) -> None:
        self.config = config
        self.engine = Engine(config) if filler_token_ids is None else Engine(
            config, filler_token_ids
        )
        self.metrics = SimMetrics(config, self.engine)
        self.clock = SimClock(config.time_scale)
        self._generations: dict[str, Generation] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._next_id = 0
        events, rank = config.kv_events, config.data_parallel_rank
        self.kv_events: Publisher | None = None if events is None else Publisher(events, rank)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-step-loop")

    async def close(self) -> None:
        """Stop stepping; every unfinished generation ends as aborted."""
        if self.kv_events is not None:
            await self.kv_events.close()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
        for generation in self._generations.values():
            generation._update(generation.num_ready, FinishReason.ABORT)
        self._generations.clear()

    def unique_id(self, base: str) -> str:
        """An engine request id: the client's X-Request-Id when free, else with a suffix."""
        if base not in self.engine.requests:
            return base
        self._next_id += 1
        return f"{base}-{self._next_id}"

    def check_admission(self, sequences: int) -> None:
        """vLLM's queue limits for a request of `sequences` engine requests: raises
        AdmissionRejected (and counts it) when they refuse it. Unfinished: every generation
        not ended; in prefill: those without an output token yet, by their whole prompt."""
        config = self.config
        if config.max_num_queued_reqs is None and config.max_num_queued_tokens is None:
            return
        generations = self._generations.values()
        reason = rejection(
            max_num_queued_reqs=config.max_num_queued_reqs,
            max_num_queued_tokens=config.max_num_queued_tokens,
            unfinished=len(generations),
            queued_tokens=sum(g.request.num_prompt_tokens for g in generations if not g.num_ready),
            sequences=sequences,
        )
        if reason is not None:
            self.metrics.observe_admission_rejection(reason)
            raise AdmissionRejected(reason)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int | None,
        *,
        ignore_eos: bool = False,
        output_len: int | None = None,
        priority: int = 0,
    ) -> Generation:
        """Queue a request (raises ContextLengthError) and wake the step loop; `output_len`
        as `Engine.add_request` takes it."""
        request = self.engine.add_request(
            request_id, prompt_token_ids, max_tokens, self.clock.now(),
            ignore_eos=ignore_eos, output_len=output_len, priority=priority,
        )
        generation = Generation(request)
        self._generations[request_id] = generation
        self._wake.set()
        return generation

    def abort(self, generation: Generation) -> None:
        """End a generation early (client gone, connection dropped); frees its blocks."""
        if generation.finished:
            return
        self._generations.pop(generation.request_id, None)
        request = self.engine.abort(generation.request_id, self.clock.now())
        generation._update(generation.num_ready, FinishReason.ABORT)
        if request is not None:
            self.metrics.observe_finished(request)
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """vLLM's /reset_prefix_cache: False while a request holds blocks."""
        done = self.engine.pool.reset()
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.pool.take_events())
        return done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine, clock, scale = self.engine, self.clock, self.config.time_scale
        while True:
            if not engine.has_unfinished_requests():
                await self._sleep_until_woken()
                continue
            started = loop.time()
            result = engine.step(clock.now())
            if result.idle:  # nothing can be scheduled: wait for an arrival or an abort
                await self._sleep_until_woken()
                continue
            clock.advance(result.cost_s)
            delay = result.cost_s * scale - (loop.time() - started)
            await asyncio.sleep(delay if delay > 0 else 0)
            self._deliver(result)

    async def _sleep_until_woken(self) -> None:
        self.clock.idle()
        self._wake.clear()
        await self._wake.wait()
        self.clock.busy()

    def _deliver(self, result: StepResult) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.pool.take_events())
        metrics = self.metrics
        metrics.observe_step(result)
        generations = self._generations
        for output in result.outputs:
            metrics.observe_token(output)
            generation = generations.get(output.request.request_id)
            if output.finish_reason is not None:
                metrics.observe_finished(output.request)
                generations.pop(output.request.request_id, None)
            if generation is not None:
                generation._update(output.index + 1, output.finish_reason)
