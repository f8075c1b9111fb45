"""One stream of vLLM's KV cache events into what kvgate knows of it: a replica's, or one of
its data-parallel ranks' (each rank publishes on ports of its own).

A vLLM started with `--kv-events-config` publishes, after each engine step that changed its
prefix cache, one batch on a ZMQ PUB socket (topic, 8-byte big-endian sequence number,
msgpack) and keeps the recent batches for a ROUTER replay socket (`kvgate.sim.kv_events` is
the simulator's publisher, checked against vLLM's classes). Here:

- `Sequencer` decides from sequence numbers: the next one is applied; a jump is a gap,
  filled by a replay; a number that went back (the engine restarted and counts from 0
  again) resets the index and replays from 0, unless it is a batch the replay brought
  already, byte for byte (a duplicate).
- `ReplicaEvents` is what a stream's readers see: its block index, and the prompts sent
  there lately that count as cached before their events come.
- `Subscriber` is the I/O: one SUB socket and, for replays, a DEALER on the replay socket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import zmq
import zmq.asyncio

from kvgate.config import KvEventsConfig
from kvgate.fleet.block_index import BlockIndex, LazyKeys
from kvgate.fleet.engine_hash import EngineMatch
from kvgate.fleet.kv_wire import Batch, decode_batch
from kvgate.metrics import Metrics

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay socket's end marker
RETRY_S = 1.0  # after a socket error, before subscribing again
GATHER_S = 0.01  # between reads of the socket while batches keep coming
Verdict = Literal["first", "apply", "gap", "regressed", "duplicate"]


@dataclass(slots=True)
class Sequencer:
    """Where a batch's sequence number puts it: `last` applied, and the batches the latest
    replay applied that the live stream may still bring (their payloads' digests): one of
    those, byte for byte, is a duplicate; any other number at or below `last` means the
    engine counts from 0 again."""

    last: int | None = None
    replayed: dict[int, int] = field(default_factory=dict)

    def verdict(self, seq: int, digest: int) -> Verdict:
        if self.last is None:
            return "first"
        if seq == self.last + 1:
            return "apply"
        if seq > self.last + 1:
            return "gap"
        if self.replayed.get(seq) == digest:
            return "duplicate"
        return "regressed"


@dataclass(slots=True)
class ReplicaEvents:
    """What one stream's subscriber knows (a replica's, or one data-parallel rank's of it),
    for the index's readers and /admin/replicas."""

    index: BlockIndex
    # matching by the engine's own block hashes too, where the pool says how it hashes
    engine: EngineMatch | None = None
    stream: str = ""  # its name in the fleet (`kvgate.fleet.kv_events.stream_name`)
    rank: int = 0  # the replica's data-parallel rank it follows
    sequencer: Sequencer = field(default_factory=Sequencer)
    # the block keys of prompts sent there lately: cached, as far as routing is concerned,
    # before their BlockStored events arrive; (until when, keys) in the order sent
    expected: Counter[int] = field(default_factory=Counter)
    expiries: deque[tuple[float, list[int]]] = field(default_factory=deque)
    last_event_at: float | None = None  # monotonic, of the last batch applied
    engine_started_at: float | None = None  # the engine's start the index was built under
    # the replica's prompt tokens that missed its cache (vLLM's queries - hits), as scraped
    # when a batch had last come: what it computed since must show up as BlockStored
    misses_at_event: float | None = None
    batches_seen: int = 0  # `batches` at the last check
    batches: int = 0
    gaps: int = 0
    resets: int = 0

    def holds(self, key: int) -> bool:
        return self.index.holds(key) or key in self.expected

    def leading(self, prompt: LazyKeys) -> int:
        """How many of the prompt's leading blocks the replica holds, or is about to."""
        if self.engine is None:
            return prompt.leading(self.holds)
        return self.engine.leading(prompt, self.index, self.holds)

    def saw(self, misses: float | None) -> None:
        """The replica's cache misses as scraped now: kept as of the last batch, the first
        time they are seen after one."""
        if self.batches != self.batches_seen or self.misses_at_event is None:
            self.batches_seen, self.misses_at_event = self.batches, misses

    def unexpect(self, keys: Iterable[int]) -> None:
        """The replica evicted these blocks: no prompt sent lately counts them as cached
        any more (their expiries, still queued, find nothing left to drop)."""
        for key in keys:
            self.expected.pop(key, None)

    def forget_expected(self, now: float | None = None) -> None:
        """Drop the expectations that run out by `now` (all of them: None)."""
        while self.expiries and (now is None or self.expiries[0][0] <= now):
            for key in self.expiries.popleft()[1]:
                left = self.expected.get(key, 0) - 1
                if left > 0:
                    self.expected[key] = left
                else:
                    self.expected.pop(key, None)


class Subscriber:
    """One stream's events into its `ReplicaEvents`, until cancelled."""

    def __init__(
        self, stream: str, endpoint: str, replay_endpoint: str | None,
        settings: KvEventsConfig, state: ReplicaEvents, metrics: Metrics,
    ) -> None:
        self.stream = stream
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.settings, self.state, self.metrics = settings, state, metrics
        self._ctx = zmq.asyncio.Context.instance()
        # this replica's series, looked up once: a label lookup per batch cost a tenth of it
        self._lag = metrics.kv_events_lag.labels(stream)
        self._blocks = metrics.kv_index_blocks.labels(stream)
        self._kinds: dict[str, Any] = {}

    async def run(self) -> None:
        """Subscribe, and subscribe again after a socket error, until cancelled. A new
        subscription starts from an empty index and a replay from 0: what was missed while
        away may be anything, an engine's restart included, and the old index under a new
        engine's replay would count blocks it no longer holds."""
        while True:
            try:
                await self._subscribed()
            except Exception as exc:  # a subscriber must not die of what it reads: it says so
                log.warning("KV events of %s (%s): %s", self.stream, self.endpoint, exc)
            if self.state.sequencer.last is not None:
                self._reset("reconnect")
            await asyncio.sleep(RETRY_S)

    async def _subscribed(self) -> None:
        socket = self._ctx.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, self.settings.topic.encode())
        socket.connect(self.endpoint)
        # the same socket read without asyncio: what has arrived is drained with no future
        # per message (an asyncio socket answers even a non-blocking read with one)
        ready: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        try:
            while True:
                frames: list[bytes] | None = await socket.recv_multipart()
                while frames is not None:
                    if len(frames) == 3:
                        _, seq, payload = frames
                        await self.receive(int.from_bytes(seq, "big", signed=True), payload)
                    frames = _ready(ready)  # what has arrived meanwhile, without a wakeup
                # then let batches gather: a wakeup per batch cost more than the batches
                await asyncio.sleep(GATHER_S)
        finally:
            socket.close()

    async def receive(self, seq: int, payload: bytes) -> None:
        """One live batch: applied, or what its number says to do first."""
        state = self.state
        verdict = state.sequencer.verdict(seq, hash(payload))
        if verdict == "duplicate":
            return
        if verdict == "apply":
            state.sequencer.replayed.clear()  # the live stream is past what the replay brought
            self._apply(seq, payload)
            return
        if verdict == "regressed":
            self._reset("regressed")
        start = 0 if verdict in ("first", "regressed") else (state.sequencer.last or 0) + 1
        if verdict == "gap":
            self._count_gap()
        replayed = await self._replay(start)
        if state.sequencer.last is None or state.sequencer.last < seq:
            # the replay did not reach this batch (no replay socket, or it no longer had
            # them): what it lacked is lost (a gap is counted once), and this batch is
            # applied as it came
            if verdict != "gap" and (replayed or (verdict == "regressed" and seq > start)):
                self._count_gap()
            self._apply(seq, payload)

    async def _replay(self, start: int) -> int:
        """Ask the replay socket for every batch from `start` and apply them; how many came."""
        if self.replay_endpoint is None:
            return 0
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.replay_endpoint)
        count = 0
        try:
            await socket.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                async with asyncio.timeout(self.settings.replay_timeout_s):
                    frames = await socket.recv_multipart()
                if len(frames) not in (3, 4):  # (empty, [topic,] seq, payload): with the
                    continue  # topic since vLLM added it, without before
                seq_bytes, payload = frames[-2], frames[-1]
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return count
                last = self.state.sequencer.last
                if last is None or seq > last:
                    if count == 0 and seq > start:  # the replica no longer had them all
                        self._count_gap()
                    self._apply(seq, payload)
                    self.state.sequencer.replayed[seq] = hash(payload)
                    count += 1
        except TimeoutError:
            log.warning("KV events of %s: replay from %d timed out", self.stream, start)
            return count
        finally:
            socket.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        state, metrics = self.state, self.metrics
        try:
            batch = decode_batch(payload)
        except (ValueError, TypeError, KeyError) as exc:  # whatever a producer sent
            log.warning("KV events of %s: batch %d not read: %s", self.stream, seq, exc)
            metrics.kv_events.labels(self.stream, "unreadable").inc()
            batch = Batch(time.time(), [], 0)
        kinds: Counter[str] = Counter()
        orphans = state.index.orphans
        for event in batch.events:
            if event.parent is None and event.kind == "stored" and state.engine is not None \
                    and event.salts is None and event.hashes:  # a root block: hashed as here?
                state.engine.check(event.hashes[0], event.token_ids[: event.block_size])
            gone = state.index.apply(event)
            if event.kind == "cleared":
                state.forget_expected()
            elif gone:  # evicted: a prompt sent lately that expected them will not find them
                state.unexpect(gone)
            kinds[event.kind] += 1
        for kind, count in kinds.items():
            counter = self._kinds.get(kind)
            if counter is None:
                counter = self._kinds[kind] = metrics.kv_events.labels(self.stream, kind)
            counter.inc(count)
        if batch.unknown:
            metrics.kv_events.labels(self.stream, "unknown").inc(batch.unknown)
        if state.index.orphans > orphans:
            metrics.kv_index_orphans.labels(self.stream).inc(state.index.orphans - orphans)
        state.sequencer.last = seq
        state.last_event_at = time.monotonic()
        state.batches += 1
        self._lag.set(max(0.0, time.time() - batch.ts))
        self._blocks.set(len(state.index))

    def _reset(self, reason: str) -> None:
        self.state.index.clear()
        self.state.forget_expected()
        self.state.sequencer = Sequencer()
        self.state.resets += 1
        self.metrics.kv_events_resets.labels(self.stream, reason).inc()

    def _count_gap(self) -> None:
        self.state.gaps += 1
        self.metrics.kv_events_gaps.labels(self.stream).inc()


def _ready(socket: zmq.Socket[bytes]) -> list[bytes] | None:
    """The next message already received, or None."""
    try:
        return socket.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None
