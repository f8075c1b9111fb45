"""Log lines written by a thread, in batches: the event loop never waits on stderr.

With the access log on, kvgate logs a line per request. Written straight from the event loop,
each line is a `write` syscall, and a stderr that does not drain (a container runtime's log
pipe under pressure: 64 KiB, ~200 lines) blocks the loop there, and every request with it.
Handing each record to a thread (`logging.handlers.QueueHandler`) frees the loop but costs
more CPU than it saves (formatting in the thread, a GIL hand-off per line: +8% per request).

So a line is formatted where it is logged and appended to a buffer; a writer thread wakes at
most every BATCH_S, takes everything buffered and writes it in one call. While the stream is blocked, lines wait in memory up to `max_pending_bytes` (besides
the batch being written, at most as large); beyond
that they are dropped and counted, and the count is written when the stream drains — a
stalled log costs lines, never requests or unbounded memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TextIO

MAX_PENDING_BYTES = 64 * 1024 * 1024
# The writer gathers lines this long before writing them: it wakes (and takes the GIL from the
# event loop) at most this often, not once per line (which cost 8% of the CPU per request).
BATCH_S = 0.05
# Each write is at most this many bytes, whole lines: a pipe writes that much atomically, so the
# lines of `--workers N` processes sharing one stderr never splice into each other.
PIPE_BUF = 4096


class BatchingHandler(logging.Handler):
    def __init__(
        self, stream: TextIO, formatter: logging.Formatter | None = None,
        max_pending_bytes: int = MAX_PENDING_BYTES, batch_s: float = BATCH_S,
    ) -> None:  # fmt: skip
        super().__init__()
        self.batch_s = batch_s
        self.stream = stream
        self.setFormatter(formatter)
        self.max_pending_bytes = max_pending_bytes
        self.dropped = 0  # lines dropped since the last write
        self._lines: list[str] = []
        self._pending = 0
        self._buffer_lock = threading.Lock()
        self._ready = threading.Event()
        self._closing = False
        self._writer = threading.Thread(target=self._write_batches, name="kvgate-log", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:
            self.handleError(record)
            return
        with self._buffer_lock:
            if self._pending + len(line) > self.max_pending_bytes:
                self.dropped += 1
                return
            self._lines.append(line)
            self._pending += len(line)
        if not self._ready.is_set():
            self._ready.set()

    def _write_batches(self) -> None:
        while True:
            self._ready.wait()
            if not self._closing:
                time.sleep(self.batch_s)
            with self._buffer_lock:
                self._ready.clear()
                lines, self._lines, self._pending = self._lines, [], 0
                dropped, self.dropped = self.dropped, 0
                closing = self._closing
            note = [f"kvgate: {dropped} log lines dropped: the log stream was blocked or "
                    "failing\n"] if dropped else []  # fmt: skip
            batch = note + lines
            for written, chunk in _chunks(batch, PIPE_BUF):
                try:
                    self.stream.write(chunk)
                    self.stream.flush()
                except Exception:  # the stream failed (or is closed at exit): count, carry on
                    lost = len(lines) + dropped if written == 0 else len(batch) - written
                    with self._buffer_lock:
                        self.dropped += lost
                    break
            if closing:
                return

    def close(self) -> None:
        """Write what is buffered (waiting at most 5 s for a blocked stream), then stop the
        writer. Again (logging's own shutdown calls it too): nothing."""
        with self._buffer_lock:
            if self._closing:
                return
            self._closing = True
        self._ready.set()
        self._writer.join(timeout=5.0)
        super().close()


def _chunks(lines: list[str], limit: int) -> Iterator[tuple[int, str]]:
    """Whole lines joined into pieces of at most `limit` bytes (a longer line alone), each with
    the number of lines before it."""
    start, size = 0, 0
    for i, line in enumerate(lines):
        n = len(line.encode())
        if size and size + n > limit:
            yield start, "".join(lines[start:i])
            start, size = i, 0
        size += n
    if start < len(lines):
        yield start, "".join(lines[start:])


def write_logs_from_a_thread() -> list[logging.Handler]:
    """Replace the root logger's stream handlers with batching ones (same stream, same format);
    returns the handlers replaced, for `restore`."""
    root = logging.getLogger()
    replaced = list(root.handlers)
    # a plain stream handler only (basicConfig's): file handlers reopen and rotate their files
    root.handlers = [_batching(h) if type(h) is logging.StreamHandler else h for h in replaced]
    return replaced


def _batching(handler: logging.StreamHandler[TextIO]) -> BatchingHandler:
    batching = BatchingHandler(handler.stream, handler.formatter)
    batching.setLevel(handler.level)
    for log_filter in handler.filters:
        batching.addFilter(log_filter)
    return batching


def restore(replaced: list[logging.Handler]) -> None:
    """Flush and stop the batching handlers; put the originals back."""
    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler, BatchingHandler):
            handler.close()
    root.handlers = replaced
