"""Real vLLM engines on this machine's CPUs: vLLM's CPU build serving the tiny model.

`./scripts/vllm-cpu install` puts vLLM's CPU build into a cached virtualenv of its own (vLLM and
kvgate never share one); this module starts engines from it with the flags a test or a
benchmark asks for, waits until each answers, and stops them with nothing left behind:

    async with running([EngineSpec(num_blocks=64), EngineSpec()]) as engines:
        ...  # engines[0].url, engines[0].kv_events (a ZMQ endpoint) ...

Each engine is `python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails in the
CPU build: its metadata is named vllm-cpu) in a session of its own, so that stopping it stops
its engine core and workers too. Its output goes to a log file, read back when it fails.
The workarounds each flag answers are in docs/real-vllm.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from kvgate.tools.tiny_model import MODEL_NAME, make_model

VLLM_CPU_VERSION = "0.32.0"
VENV_VARIABLE = "KVGATE_VLLM_CPU_VENV"
START_TIMEOUT_S = 240.0


class EngineError(RuntimeError):
    """An engine could not be started, or stopped answering while it was being started."""


def venv() -> Path:
    """Where `./scripts/vllm-cpu install` put vLLM's CPU build."""
    configured = os.environ.get(VENV_VARIABLE)
    if configured:
        return Path(configured)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "kvgate" / f"vllm-cpu-{VLLM_CPU_VERSION}"


def installed() -> bool:
    return (venv() / "bin" / "python").exists() and (venv() / ".kvgate-ready").exists()


def default_model_dir() -> Path:
    return Path(tempfile.gettempdir()) / "kvgate-tiny-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine's flags. Block size must be a multiple of 32 on the CPU build."""

    num_blocks: int = 256
    block_size: int = 32
    max_model_len: int | None = None  # None: 4,096, or what the blocks hold less one
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    kv_events: bool = False  # publish KV cache events over ZMQ (and serve their replay)
    max_num_queued_reqs: int | None = None  # vLLM answers 503 past this many waiting
    scheduling_policy: str = "fcfs"  # or "priority"
    # The cores it is bound to ("0", "1", "0-1"), one OpenMP thread each; None: unbound, one
    # thread. Never more threads than cores: several engines' spinning OpenMP threads on two
    # cores cut the fleet's throughput about twelvefold (bench/results/real-fleet-2026-12-07.md).
    cpus: str | None = None
    # Without torch.compile: ready in about 20 s instead of 45 s (CUDA graphs do not exist here).
    eager: bool = True
    # vLLM's dev endpoints, among them POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE).
    dev_mode: bool = False
    extra: tuple[str, ...] = ()

    @property
    def model_len(self) -> int:
        """vLLM refuses to start unless one request of this length fits the blocks."""
        fits = (self.num_blocks - 1) * self.block_size
        return self.max_model_len or min(4096, fits)


@dataclass(slots=True)
class Engine:
    spec: EngineSpec
    model_dir: Path
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def kv_replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def command(self) -> list[str]:
        spec = self.spec
        args = [
            str(venv() / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--model", str(self.model_dir), "--served-model-name", MODEL_NAME,
            "--load-format", "dummy", "--dtype", "bfloat16", "--seed", "0",
            "--block-size", str(spec.block_size),
            "--num-gpu-blocks-override", str(spec.num_blocks),
            "--max-model-len", str(spec.model_len),
            "--max-num-seqs", str(spec.max_num_seqs),
            "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
            "--scheduling-policy", spec.scheduling_policy,
            "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
        ]
        if spec.eager:
            args.append("--enforce-eager")
        if spec.max_num_queued_reqs is not None:
            args += ["--max-num-queued-reqs", str(spec.max_num_queued_reqs)]
        if spec.kv_events:
            args += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                # a wildcard host binds the PUB socket; a named host makes vLLM connect it
                "endpoint": f"tcp://*:{self.events_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
                "topic": "kv-events",
            })]
        return [*args, *spec.extra]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
        env.update(
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            # The KV cache is sized by --num-gpu-blocks-override; this only bounds it (GiB).
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=self.spec.cpus or "nobind",
            OMP_NUM_THREADS=str(_count_cpus(self.spec.cpus) if self.spec.cpus else 1),
            TORCHINDUCTOR_CACHE_DIR=str(Path(tempfile.gettempdir()) / "kvgate-vllm-inductor"),
        )
        if self.spec.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    def start(self) -> None:
        handle, name = tempfile.mkstemp(prefix=f"kvgate-vllm-{self.port}-", suffix=".log")
        self.log_path = Path(name)
        command = self.command()
        if self.spec.cpus is not None and shutil.which("taskset"):
            command = ["taskset", "-c", self.spec.cpus, *command]
        # A session of its own: stopping it signals the API server, its engine core and workers.
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
            env=self.environment(), start_new_session=True,
        )
        os.close(handle)

    async def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until /v1/models answers; raises with the engine's last output if it exits first."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while True:
                if self.process is None or self.process.poll() is not None:
                    raise EngineError(f"engine on :{self.port} exited:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    timeout = aiohttp.ClientTimeout(total=2)
                    async with session.get(f"{self.url}/v1/models", timeout=timeout) as resp:
                        if resp.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"engine on :{self.port} not ready in {timeout_s:g}s:\n{self.log_tail()}"
                    )
                await asyncio.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        """The engine's last lines, after its first error where that came earlier: an engine
        core that fails to start says why there, and its API server only that it failed."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(text)
                      if line.startswith("Traceback") or " ERROR " in line), None)  # fmt: skip
        if first is None or first >= len(text) - lines:
            return "\n".join(text[-lines:])
        return "\n".join([*text[first : first + lines], "...", *text[-lines:]])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to its whole session, then SIGKILL after `grace_s`: no worker outlives it."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # what the server left of its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    async def restart(self) -> None:
        """Stop and start again on the same ports: its cache (and KV events' state) are new."""
        await asyncio.to_thread(self.stop)
        await asyncio.to_thread(self.start)
        await self.wait_ready()


async def read_series(
    http: aiohttp.ClientSession, url: str, names: Sequence[str]
) -> dict[str, float]:
    """Each named series of an engine's /metrics, summed over its samples (0 when absent)."""
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    wanted = set(names)
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _count_cpus(cpus: str | None) -> int:
    if cpus is None:
        return os.cpu_count() or 1
    count = 0
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


@contextlib.asynccontextmanager
async def running(
    specs: Sequence[EngineSpec], model_dir: Path | None = None
) -> AsyncIterator[list[Engine]]:
    """Start one engine per spec, all at once; yield them when every one answers; stop them
    all on the way out, however it is left."""
    if not installed():
        raise EngineError(f"vLLM's CPU build is not installed at {venv()}: ./scripts/vllm-cpu install")
    directory = make_model(model_dir or default_model_dir())
    engines = [Engine(spec, directory) for spec in specs]
    try:
        for engine in engines:
            await asyncio.to_thread(engine.start)
        await asyncio.gather(*(engine.wait_ready() for engine in engines))
        yield engines
    finally:
        await asyncio.gather(*(asyncio.to_thread(engine.stop) for engine in engines))


def pinned(specs: Sequence[EngineSpec]) -> list[EngineSpec]:
    """The specs with each engine bound to a core of its own, round robin over the cores."""
    cores = os.cpu_count() or 1
    return [replace(spec, cpus=str(i % cores)) for i, spec in enumerate(specs)]


def parse_args(argv: Sequence[str] | None = None) -> tuple[list[EngineSpec], Path | None]:
    """`./scripts/vllm-cpu serve`'s flags: the engines' specs, and where the model goes."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="./scripts/vllm-cpu serve",
        description="Serve the tiny model from vLLM's CPU build until Ctrl-C (docs/real-vllm.md).")
    parser.add_argument("--engines", type=int, default=1, help="how many (1)")
    parser.add_argument("--blocks", type=int, default=256, help="KV blocks each (256)")
    parser.add_argument("--block-size", type=int, default=32, help="a multiple of 32 (32)")
    parser.add_argument("--max-model-len", type=int, help="(4,096, or what the blocks hold)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-events", action="store_true", help="publish KV cache events")
    parser.add_argument("--max-num-queued-reqs", type=int, help="503 past this many unfinished")
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    parser.add_argument("--unpinned", action="store_true",
                        help="leave the engines unbound (default: one core each, round robin)")
    parser.add_argument("--model-dir", type=Path, help=f"(default: {default_model_dir()})")
    args = parser.parse_args(argv)
    spec = EngineSpec(
        num_blocks=args.blocks, block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_events=args.kv_events, max_num_queued_reqs=args.max_num_queued_reqs,
        scheduling_policy=args.scheduling_policy,
    )
    specs = [spec] * args.engines
    return (specs if args.unpinned else pinned(specs)), args.model_dir


async def serve(specs: Sequence[EngineSpec], model_dir: Path | None) -> None:
    """Start the engines, say where they are, and keep them until Ctrl-C or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running(specs, model_dir) as engines:
        for engine in engines:
            events = f", KV events {engine.kv_events}" if engine.spec.kv_events else ""
            print(f"{engine.url}  model {MODEL_NAME}, {engine.spec.num_blocks} blocks of "
                  f"{engine.spec.block_size}, cores {engine.spec.cpus or 'any'}{events}",
                  flush=True)
        print("Ctrl-C to stop.", flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(serve(*parse_args()))
