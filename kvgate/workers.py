"""`kvgate serve --workers N`: N processes on one port, and one /metrics for all of them.

Python runs one core per process, so one kvgate per core is how a host's cores are used. The
parent process (`supervise`) starts N copies of the same `kvgate serve` command; each binds the
configured port with SO_REUSEPORT, and the kernel spreads connections across them. They share
ledgers, budgets and sessions through the state store, which is why N > 1 needs
`state.backend: redis` (with the memory store each worker would keep its own books: N times
every limit and capacity). The parent forwards SIGTERM/SIGINT (drain and stop) and SIGHUP
(reload) to every worker; if a worker dies, the parent stops the others and exits non-zero, so
that whatever runs kvgate restarts it whole rather than running on with part of its capacity.

/metrics: each worker also listens on 127.0.0.1 on a port of its own, written to a directory
the parent hands down (KVGATE_WORKERS_DIR). A scrape of /metrics on the shared port — whichever
worker takes it — fetches every other worker's own figures from there (`/metrics?own=1`) and
answers with all of them, each sample labelled `worker="<index>"`: one scrape target, every
worker's counters (sum them without `worker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)

ENV_DIR = "KVGATE_WORKERS_DIR"
ENV_INDEX = "KVGATE_WORKER_INDEX"
SCRAPE_TIMEOUT_S = 2.0


def default_workers(backend: str) -> int:
    """One worker per usable core with a shared store; one with the memory store."""
    if backend != "redis":
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def supervise(argv: Sequence[str], workers: int) -> int:
    """Run `kvgate serve ARGV` in `workers` processes until a signal stops them (or one dies);
    returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="kvgate-workers-") as directory:
        procs = []
        for index in range(workers):
            env = {**os.environ, ENV_DIR: directory, ENV_INDEX: str(index)}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvgate.cli", "serve", *argv, "--workers", "1"],
                env=env, preexec_fn=_die_with_parent,
            ))  # fmt: skip
        stopping = False

        def forward(signum: int, _frame: object) -> None:
            nonlocal stopping
            stopping = stopping or signum != signal.SIGHUP
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signum)

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, forward)
        log.info("kvgate: %d workers (pids %s)", workers, ", ".join(str(p.pid) for p in procs))
        code = 0
        while any(p.poll() is None for p in procs):
            for proc in procs:
                if proc.poll() is not None and not stopping:
                    log.critical("worker pid %d exited (%s); stopping the others", proc.pid,
                                 proc.returncode)  # fmt: skip
                    code = proc.returncode or 1
                    forward(signal.SIGTERM, None)
            time.sleep(0.2)  # a signal runs `forward` meanwhile
        return code or max((p.returncode or 0) for p in procs)


def _die_with_parent() -> None:
    """In a worker before exec: killed with the parent, even if the parent is SIGKILLed
    (Linux), as if the workers were the one process they replace."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Peers:
    """This worker's place among its siblings: where each serves its own /metrics."""

    def __init__(self, directory: Path, index: int) -> None:
        self.directory = directory
        self.index = index

    @classmethod
    def from_env(cls) -> Peers | None:
        directory = os.environ.get(ENV_DIR)
        return None if directory is None else cls(Path(directory), int(os.environ[ENV_INDEX]))

    def announce(self, port: int) -> None:
        path = self.directory / f"{self.index}.port"
        path.with_suffix(".tmp").write_text(str(port))
        path.with_suffix(".tmp").rename(path)

    def others(self) -> dict[int, int]:
        """index -> private port of every other worker that has announced itself."""
        out = {}
        for path in self.directory.glob("*.port"):
            index = int(path.stem)
            if index != self.index:
                out[index] = int(path.read_text())
        return out

    async def merged(self, own: bytes) -> bytes:
        """Every worker's exposition as one, each sample labelled with its worker."""
        texts = {self.index: own.decode()}
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:

            async def scrape(index: int, port: int) -> None:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/metrics?own=1") as response:
                        texts[index] = await response.text()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    log.warning("worker %d's /metrics did not answer: %s", index, exc)

            await asyncio.gather(*(scrape(i, p) for i, p in self.others().items()))
        return merge(texts)


PEERS = web.AppKey("peers", Peers)


def merge(texts: dict[int, str]) -> bytes:
    """Prometheus expositions, one per worker, as one with a `worker` label on every sample."""
    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)  # fmt: skip
            merged.samples.extend(_labelled(family.samples, str(index)))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


def _labelled(samples: Iterable[Sample], worker: str) -> list[Sample]:
    return [s._replace(labels={"worker": worker, **s.labels}) for s in samples]


class _Fixed:
    """A collector that returns the families it was given."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


async def private_site(runner: web.AppRunner, peers: Peers) -> web.TCPSite:
    """This worker's own address for its siblings' /metrics scrapes (127.0.0.1, any port)."""
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    peers.announce(int(sockets[0].getsockname()[1]))
    return site
