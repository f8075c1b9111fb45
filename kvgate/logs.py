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
from typing import TextIO

MAX_PENDING_BYTES = 64 * 1024 * 1024
# The writer gathers lines this long before writing them: it wakes (and takes the GIL from the
# event loop) at most this often, not once per line (which cost 8% of the CPU per request).
BATCH_S = 0.05


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
            try:
                if dropped:
                    lines.append(f"kvgate: {dropped} log lines dropped: the log stream was "
                                 "blocked and the buffer full\n")  # fmt: skip
                if lines:
                    self.stream.write("".join(lines))
                    self.stream.flush()
            except (OSError, ValueError):  # the stream is gone (closed at exit): nowhere to say it
                pass
            if closing:
                return

    def close(self) -> None:
        """Write what is buffered, then stop the writer."""
        with self._buffer_lock:
            self._closing = True
        self._ready.set()
        self._writer.join(timeout=5.0)
        super().close()


def write_logs_from_a_thread() -> list[logging.Handler]:
    """Replace the root logger's stream handlers with batching ones (same stream, same format);
    returns the handlers replaced, for `restore`."""
    root = logging.getLogger()
    replaced = list(root.handlers)
    root.handlers = [_batching(h) if isinstance(h, logging.StreamHandler) else h for h in replaced]
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
