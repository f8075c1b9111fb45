"""`SimReplica`: one simulated vLLM server on a real socket, with its faults and lifecycle.

    replica = SimReplica(SimConfig(num_gpu_blocks=512, time_scale=0.01))
    await replica.start()            # port 0 = a free port; replica.url is set
    replica.faults = Faults(error_rate=0.5)
    await replica.restart()          # the listener closes and reopens; engine state is lost
    await replica.stop()

The listener, the engine runtime (engine, metrics, step loop) and the aiohttp app are built
together on every start, and torn down together on every stop, as a real process restart
would. Faults and the tokenizer survive restarts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.api import build_app
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.faults import Faults
from kvgate.sim.runtime import EngineRuntime
from kvgate.sim.text import PromptEncoder, TextTokenizer

log = logging.getLogger(__name__)

# Seconds a stop waits for in-flight handlers before cancelling them (a crash cuts them).
STOP_GRACE_S = 0.05


class SimReplica:
    def __init__(self, config: SimConfig, *, tokenizer: TextTokenizer | None = None) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._encoder: PromptEncoder | None = None
        self._faults = config.faults
        self._faults_changed = asyncio.Event()
        # Chance-based faults draw from their own seeded stream, apart from the engine's.
        self.fault_rng = random.Random(config.seed ^ 0x5EED)
        self._runtime: EngineRuntime | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lifecycle = asyncio.Lock()
        self.host = "127.0.0.1"
        self.port = 0
        # where the KV events are published (None: off), bound on the first start and kept
        # across restarts, as the HTTP port is
        self.kv_events_endpoints: dict[str, str] | None = None
        self.starts = 0
        self.held_by_faults = 0  # /v1 requests waiting out added latency or a hang right now

    # ------------------------------------------------------------------ accessors

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    @property
    def runtime(self) -> EngineRuntime:
        if self._runtime is None:
            raise RuntimeError("the replica is not running")
        return self._runtime

    @property
    def engine(self) -> Engine:
        return self.runtime.engine

    @property
    def encoder(self) -> PromptEncoder:
        if self._encoder is None:
            raise RuntimeError("the replica has not been started")
        return self._encoder

    @property
    def faults(self) -> Faults:
        return self._faults

    @faults.setter
    def faults(self, value: Faults) -> None:
        """Replace the faults; a change of `stopped` closes or reopens the listener soon after
        (await `set_faults` to wait for it)."""
        changed_stop = value.stopped != self._faults.stopped
        self._set(value)
        if changed_stop:
            self.spawn(self._apply_stopped())

    async def set_faults(self, value: Faults) -> None:
        self._set(value)
        await self._apply_stopped()

    async def faults_changed(self) -> None:
        """Wait for the next change of faults (hung requests wait on this)."""
        await self._faults_changed.wait()

    def _set(self, value: Faults) -> None:
        self._faults = value
        self._faults_changed.set()
        self._faults_changed = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Build the engine and listen; port 0 picks a free port (then kept across restarts)."""
        self.host, self.port = host, port
        if self._encoder is None:
            if self._tokenizer is None:
                self._tokenizer = await asyncio.to_thread(load_tiktoken)
            self._encoder = PromptEncoder(self._tokenizer)
        if not self._faults.stopped:
            async with self._lifecycle:
                await self._start_listener()

    async def stop(self) -> None:
        """Close the listener and the engine, and cancel pending background work."""
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        async with self._lifecycle:
            await self._stop_listener()

    async def restart(self) -> None:
        """Stop and start again on the same port: in-flight requests are cut, state is lost."""
        async with self._lifecycle:
            await self._stop_listener()
            if self._faults.stopped:
                self._set(dataclasses.replace(self._faults, stopped=False))
            await self._start_listener()

    async def stop_for(self, seconds: float | None) -> None:
        """Stop as a fault (`stopped` set); restart by itself after `seconds` if given."""
        await self.set_faults(dataclasses.replace(self._faults, stopped=True))
        if seconds is not None:
            await asyncio.sleep(seconds)
            await self.set_faults(dataclasses.replace(self._faults, stopped=False))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run background work with a reference kept (and cancelled by `stop`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("sim replica %s: background task failed", self.url, exc_info=task.exception())

    async def _apply_stopped(self) -> None:
        async with self._lifecycle:
            if self._faults.stopped:
                await self._stop_listener()
            elif self._runner is None and self._encoder is not None:
                await self._start_listener()

    async def _start_listener(self) -> None:
        if self._runner is not None:
            return
        runtime = EngineRuntime(self.config)
        runner = web.AppRunner(
            build_app(self, runtime),
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=STOP_GRACE_S,
            access_log=None,
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        try:
            if runtime.kv_events is not None:
                await runtime.kv_events.open(self.kv_events_endpoints)
                self.kv_events_endpoints = runtime.kv_events.bound
        except BaseException:
            await runner.cleanup()
            await runtime.close()
            raise
        runtime.start()
        if self.port == 0:
            self.port = _bound_port(runner)
        self._runner, self._runtime = runner, runtime
        self.starts += 1

    async def _stop_listener(self) -> None:
        runner, runtime = self._runner, self._runtime
        self._runner = self._runtime = None
        if runner is not None:
            await runner.cleanup()
        if runtime is not None:
            await runtime.close()


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    raise RuntimeError("the replica's listener has no TCP address")
