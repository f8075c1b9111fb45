"""Every test fails if kvgate's code or the test's own code blocks the event loop.

`blockbuster` wraps the blocking calls (time.sleep, file and socket I/O, os.stat/read/write,
lock waits, ...) so that one made while an event loop runs in this thread raises
`BlockingError`, when a frame of kvgate or of tests/ is on the stack. Code that blocks outside
a running loop (a sync test, a fixture that reads files before the loop starts, a thread of
`asyncio.to_thread`, a worker process) is not checked: it stalls nobody.

What may block, and why, is the table ALLOWED below; nothing else is let through. A test that
must block on purpose (the one that proves this check works) turns it off with the
`blocking_allowed` marker.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from blockbuster import BlockBuster, BlockingError
from blockbuster import blockbuster as blockbuster_module

# The code whose frames make a blocking call an error: kvgate itself and the tests.
SCANNED = ["kvgate", "tests"]
ROOT = Path(__file__).resolve().parents[2]

# (file, functions): a blocking call with one of these functions on the stack is let through.
ALLOWED: list[tuple[str, set[str]]] = [
    # Construction, once per process before anything is served: `kvgate serve` builds the app
    # (config, tokenizer and chat-template files, the Lua scripts) before its loop starts
    # (kvgate/commands/serve.py, `_run`); tests build theirs on the loop, as a fixture would.
    ("kvgate/app.py", {"build_app"}),
    ("kvgate/state/factory.py", {"build_store"}),
    ("kvgate/state/redis.py", {"__init__"}),
    ("kvgate/request/tokenizers.py", {"load_tiktoken", "load_tokenizer"}),
    ("kvgate/request/chat_template.py", {"load_template"}),
    ("kvgate/request/catalog.py", {"__init__"}),
    # The tests' OpenAI clients: made on the loop, one imports its transport and loads its
    # CA bundle in its constructor. kvgate has no such client.
    ("openai/_base_client.py", {"__init__"}),
    # bench/fleetbench/processes.py starts a contender with subprocess.Popen (it waits for
    # the exec): the set-up of a bench test.
    ("bench/fleetbench/processes.py", {"start"}),
    # A log record: `kvgate serve` hands every one to a writer thread (kvgate/logs.py, tested
    # in tests/test_logs.py); under pytest, records go to its capture or to stderr instead.
    ("logging/__init__.py", {"emit"}),
    # Known blocks of kvgate on its own loop, reported to be fixed, let through until then:
    # `kvgate demo` runs its simulated fleet on its own loop and, on that loop, imports
    # matplotlib and writes its report and figures: it delays only the demo's own figures.
    ("kvgate/commands/demo.py", {"run", "_main"}),
    # redis-py, for each new connection of a pool, looks its own version up in the installed
    # packages' metadata (os.stat of every sys.path entry): kvgate's RedisStore could pass
    # the pool lib_version to skip it.
    ("redis/utils.py", {"get_lib_version"}),
    # The endpoint picker's gRPC server, stopping with its app: grpc.aio joins its poller
    # thread then (a fraction of a second, once, when the app stops), and must do it on the
    # loop it runs on (kvgate/epp/server.py, `stop`).
    ("kvgate/epp/server.py", {"stop"}),
]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "blocking_allowed: the test may block the event loop (blockbuster is off)"
    )


def detector() -> BlockBuster:
    """blockbuster over kvgate and tests/, with ALLOWED let through."""
    buster = BlockBuster(SCANNED)
    for function in buster.functions.values():
        for filename, names in ALLOWED:
            function.can_block_in(filename, names)
    return buster


def where_blocked() -> str:
    """The innermost frame of kvgate or tests/ on the stack, as file:line function."""
    stack = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
    for frame in stack:
        path = Path(frame.filename)
        scanned = path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in SCANNED
        if scanned and path != Path(__file__).resolve():
            return f"{path.relative_to(ROOT)}:{frame.lineno} {frame.name}"
    return "?"


@dataclass
class Blocked:
    """The blocking calls made on the loop during one test, by name: those raised where the
    test never sees them (a server's handler, a background task) included."""

    calls: list[str] = field(default_factory=list)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """BlockingError records each call it is raised for. blockbuster raises the class
        bound to its module's name `BlockingError`: that binding is what is swapped."""
        calls = self.calls

        class Recorded(BlockingError):
            def __init__(self, func: str) -> None:
                super().__init__(func)
                calls.append(f"{func} from {where_blocked()}")

        blockbuster_module.BlockingError = Recorded  # type: ignore[misc]
        try:
            yield
        finally:
            blockbuster_module.BlockingError = BlockingError  # type: ignore[misc]


@pytest.fixture(autouse=True)
def blockbuster(request: pytest.FixtureRequest) -> Iterator[Blocked | None]:
    """blockbuster active for the whole test, its function-scoped fixtures included; the
    test fails at teardown if anything blocked the loop, even where the error was swallowed.
    A test that blocks on purpose clears `calls` once it has checked them."""
    if request.node.get_closest_marker("blocking_allowed"):
        yield None
        return
    blocked = Blocked()
    buster = detector()
    with blocked.recording():
        buster.activate()
        try:
            yield blocked
        finally:
            buster.deactivate()
    if blocked.calls:
        pytest.fail("blocked the event loop (see tests/plugins/blocking.py):\n  "
                    + "\n  ".join(blocked.calls), pytrace=False)
