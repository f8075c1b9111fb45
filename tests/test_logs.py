"""Log lines leave through a writer thread in batches: logging never waits on the stream, a
blocked stream costs lines beyond a bound (counted and reported), never memory or time."""

from __future__ import annotations

import logging
import os
import threading
import time

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
    assert handler.dropped > 0
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(read_all(r)))
    reader.start()  # the stream drains now
    handler.close()
    stream.close()
    reader.join(5)
    lines = out[0].splitlines()
    written = [x for x in lines if x == line]
    note = [x for x in lines if "log lines dropped" in x]
    assert len(note) == 1
    dropped = int(note[0].split()[1])
    assert len(written) + dropped == 5_000
    # at most the bound waiting, one batch as large being written, and what the pipe held
    assert len(written) * 100 <= 2 * 200_000 + 70_000
