"""Child processes of one run: started with a log each, waited on until they answer, and
stopped whatever happens — on return, on an exception or Ctrl-C (`async with`), at exit
(atexit), and if the benchmark itself is killed (the kernel's parent-death signal)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 40.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Children:
    """The processes of one run, by name. `async with Children(logs)`: every one is stopped
    on the way out (SIGTERM, then SIGKILL after `grace_s`)."""

    def __init__(self, logs: Path, grace_s: float = 5.0) -> None:
        self.logs = logs
        self.grace_s = grace_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        atexit.register(self.stop)

    async def __aenter__(self) -> Children:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await asyncio.to_thread(self.stop)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> None:
        """Start `argv` in `cwd` (the repository root by default: `python -m` imports from
        there first, so another checkout's code runs from its own root)."""
        if name in self.procs:
            raise ValueError(f"{name}: already started")
        with (self.logs / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                argv, cwd=cwd or ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent,
            )  # fmt: skip

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def exited(self) -> str:
        """Every process that has exited, with its code and its log's tail ('' if none)."""
        return "\n".join(
            f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}"
            for name, proc in self.procs.items() if proc.poll() is not None
        )

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def stop(self) -> None:
        """End every process (idempotent)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + self.grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        atexit.unregister(self.stop)

    async def wait_ready(self, http: aiohttp.ClientSession, name: str, url: str) -> None:
        """Poll `url` until it answers 200; fail fast, with its log, if the process died."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise ChildFailed(f"{name} exited:\n{self.log_tail(name)}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)
        raise ChildFailed(f"{name} not ready after {START_TIMEOUT_S:g}s:\n{self.log_tail(name)}")


class ChildFailed(RuntimeError):
    """A child process exited or never became ready; the message carries its log's tail."""


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the benchmark dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
