"""Log lines leave through a writer thread in batches: logging never waits on the stream, a
blocked stream costs lines beyond a bound (counted and reported), never memory or time."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from kvgate.logs import BatchingHandler


def logger_with(handler: logging.Handler) -> logging.Logger:
    log = logging.getLogger(f"test-logs-{id(handler)}")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    return log


def read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_every_line_arrives_in_order_formatted_as_the_handler_it_replaced():
    r, w = os.pipe()
    stream = os.fdopen(w, "w")
    handler = BatchingHandler(stream, logging.Formatter("%(levelname)s %(message)s"))
    log = logger_with(handler)
    for i in range(1000):
        log.info("line %d", i)
    reader = threading.Thread(target=lambda: out.append(read_all(r)))
    out: list[str] = []
    reader.start()
    handler.close()
    stream.close()
    reader.join(5)
    assert out[0].splitlines() == [f"INFO line {i}" for i in range(1000)]


def test_a_stream_nobody_reads_neither_blocks_logging_nor_grows_without_bound():
    r, w = os.pipe()  # 64 KiB of pipe, then writes block
    stream = os.fdopen(w, "w")
    handler = BatchingHandler(stream, logging.Formatter("%(message)s"), max_pending_bytes=200_000)
    log = logger_with(handler)
    line = "x" * 99  # 100 bytes a line with its newline
    started = time.monotonic()
    for _ in range(5_000):  # 500 KB: the pipe and the buffer fill up
        log.info(line)
    assert time.monotonic() - started < 5  # never waited on the pipe
    # (not `handler.dropped > 0` here: the writer moves the count into its next batch's note
    # when it takes one, so the count may already be on its way)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(read_all(r)))
    reader.start()  # the stream drains now
    handler.close()
    stream.close()
    reader.join(5)
    lines = out[0].splitlines()
    written = [x for x in lines if x == line]
    notes = [x for x in lines if "log lines dropped" in x]
    assert notes  # the drops were said
    dropped = sum(int(note.split()[1]) for note in notes)
    assert dropped > 0
    assert len(written) + dropped == 5_000
    # at most the bound waiting, one batch as large being written, and what the pipe held
    assert len(written) * 100 <= 2 * 200_000 + 70_000


WORKER = """
import logging, sys, time
from kvgate.logs import restore, write_logs_from_a_thread
logging.basicConfig(level="INFO", format="%(message)s")
replaced = write_logs_from_a_thread()
log = logging.getLogger("kvgate.access")
started, i = time.monotonic(), 0
while time.monotonic() - started < 1.0:
    log.info('{"worker": "%s", "n": %d, "pad": "%s"}', sys.argv[1], i, "y" * 200)
    i += 1
    if i % 50 == 0:
        time.sleep(0.001)
restore(replaced)
"""


@pytest.mark.slow
def test_workers_sharing_one_stderr_never_splice_each_others_lines():
    # `--workers N` processes inherit one stderr pipe; with a slow reader it stays full, and
    # writes larger than the pipe's atomic size interleave mid-line.
    r, w = os.pipe()
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, tag], stderr=w)
               for tag in "ABCD"]
    os.close(w)
    data = bytearray()
    while chunk := os.read(r, 8192):
        data += chunk
        time.sleep(0.0005)  # a slow reader: the pipe stays full
    os.close(r)
    for worker in workers:
        assert worker.wait(10) == 0
    lines = data.decode().splitlines()
    assert len(lines) > 1000
    bad = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            bad.append(line)
    assert bad == []


class Failing(io.StringIO):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def write(self, text: str) -> int:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the stream broke")
        return super().write(text)


def test_a_failing_stream_costs_lines_counted_never_the_writer():
    stream = Failing(failures=1)
    handler = BatchingHandler(stream, logging.Formatter("%(message)s"), batch_s=0.01)
    log = logger_with(handler)
    log.info("lost")
    time.sleep(0.2)  # the first batch fails
    log.info("kept")
    handler.close()
    handler.close()  # again, as logging's shutdown does: nothing
    assert stream.getvalue().splitlines() == [
        "kvgate: 1 log lines dropped: the log stream was blocked or failing", "kept",
    ]
