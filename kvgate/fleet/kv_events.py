"""What each replica really caches, from vLLM's KV cache events: a subscriber per replica
keeping its `kvgate.fleet.block_index.BlockIndex`, and the fleet of them.

A vLLM started with `--kv-events-config` publishes, after each engine step that changed its
prefix cache, one batch on a ZMQ PUB socket (topic, 8-byte big-endian sequence number,
msgpack) and keeps the recent batches for a ROUTER replay socket (`kvgate.sim.kv_events` is
the simulator's publisher, checked against vLLM's classes). Here:

- `Sequencer` decides from sequence numbers: the next one is applied; a jump is a gap,
  filled by a replay; a number that went back (the engine restarted and counts from 0
  again) resets the index and replays from 0, unless it is a batch the replay brought
  already, byte for byte (a duplicate).
- `Subscriber` is the I/O: one SUB socket and, for replays, a DEALER on the replay socket.
- `KvEvents` keeps a subscriber for every replica of a pool with `kv_events` configured, and
  drops the index of a replica that fails its health check, leaves the fleet, or publishes
  nothing for `silent_after_s` while its prompts miss its cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from kvgate.config import Config, KvEventsConfig
from kvgate.fleet.block_index import BlockIndex, LazyKeys
from kvgate.fleet.engine_hash import EngineMatch, engine_hashes
from kvgate.fleet.kv_wire import Batch, decode_batch
from kvgate.fleet.replicas import Registry, Replica
from kvgate.intervals import pause
from kvgate.metrics import Metrics

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay socket's end marker
# A prompt sent to a replica counts as cached there this long, or until its events say so:
# a burst of requests for one new document would otherwise all be placed before the first
# one's blocks are published, each on whichever replica its fingerprint picks.
EXPECTED_S = 10.0
EXPECTED_BLOCKS = 2048  # of a prompt's leading blocks, at most, are expected
EXPECTED_PROMPTS = 1024  # prompts expected at once per replica, at most
RETRY_S = 1.0  # after a socket error, before subscribing again
# The index's bound until discovery knows the replica's own number of blocks.
UNKNOWN_CAPACITY = 1 << 20
GATHER_S = 0.01  # between reads of the socket while batches keep coming
# Prompt tokens a replica may compute uncached without publishing, before it counts as silent
# (64 blocks of 16: vLLM stores every full block it computes)
SILENT_MISSED_TOKENS = 1024
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
    """What one replica's subscriber knows, for the index's readers and /admin/replicas."""

    index: BlockIndex
    # matching by the engine's own block hashes too, where the pool says how it hashes
    engine: EngineMatch | None = None
    sequencer: Sequencer = field(default_factory=Sequencer)
    # the block keys of prompts sent there lately: cached, as far as routing is concerned,
    # before their BlockStored events arrive; (until when, keys) in the order sent
    expected: Counter[int] = field(default_factory=Counter)
    expiries: deque[tuple[float, list[int]]] = field(default_factory=deque)

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
    last_event_at: float | None = None  # monotonic, of the last batch applied
    engine_started_at: float | None = None  # the engine's start the index was built under
    # the replica's prompt tokens that missed its cache (vLLM's queries - hits), as scraped
    # when a batch had last come: what it computed since must show up as BlockStored
    misses_at_event: float | None = None
    batches_seen: int = 0  # `batches` at the last check
    batches: int = 0
    gaps: int = 0
    resets: int = 0


class Subscriber:
    """One replica's events into its `ReplicaEvents`, until cancelled."""

    def __init__(
        self, replica_id: str, pool: str, endpoint: str, replay_endpoint: str | None,
        settings: KvEventsConfig, state: ReplicaEvents, metrics: Metrics,
    ) -> None:
        self.replica_id, self.pool = replica_id, pool
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.settings, self.state, self.metrics = settings, state, metrics
        self._ctx = zmq.asyncio.Context.instance()
        # this replica's series, looked up once: a label lookup per batch cost a tenth of it
        self._lag = metrics.kv_events_lag.labels(replica_id)
        self._blocks = metrics.kv_index_blocks.labels(replica_id)
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
                log.warning("KV events of %s (%s): %s", self.replica_id, self.endpoint, exc)
            if self.state.sequencer.last is not None:
                self._reset("reconnect")
            await asyncio.sleep(RETRY_S)

    async def _subscribed(self) -> None:
        socket = self._ctx.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, self.settings.topic.encode())
        socket.connect(self.endpoint)
        try:
            while True:
                frames: list[bytes] | None = await socket.recv_multipart()
                while frames is not None:
                    if len(frames) == 3:
                        _, seq, payload = frames
                        await self.receive(int.from_bytes(seq, "big", signed=True), payload)
                    frames = _ready(socket)  # what has arrived meanwhile, without a wakeup
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
            log.warning("KV events of %s: replay from %d timed out", self.replica_id, start)
            return count
        finally:
            socket.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        state, metrics = self.state, self.metrics
        try:
            batch = decode_batch(payload)
        except (ValueError, TypeError, KeyError) as exc:  # whatever a producer sent
            log.warning("KV events of %s: batch %d not read: %s", self.replica_id, seq, exc)
            metrics.kv_events.labels(self.replica_id, "unreadable").inc()
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
                counter = self._kinds[kind] = metrics.kv_events.labels(self.replica_id, kind)
            counter.inc(count)
        if batch.unknown:
            metrics.kv_events.labels(self.replica_id, "unknown").inc(batch.unknown)
        if state.index.orphans > orphans:
            metrics.kv_index_orphans.labels(self.replica_id).inc(state.index.orphans - orphans)
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
        self.metrics.kv_events_resets.labels(self.replica_id, reason).inc()

    def _count_gap(self) -> None:
        self.state.gaps += 1
        self.metrics.kv_events_gaps.labels(self.replica_id).inc()


def _ready(socket: zmq.asyncio.Socket) -> list[bytes] | None:
    """The next message already received, or None (an asyncio socket's non-blocking read
    answers with a future that is already done)."""
    future: Any = socket.recv_multipart(zmq.NOBLOCK)
    try:
        return list(future.result())
    except zmq.Again:
        return None


def cache_misses(replica: Replica) -> float | None:
    """Prompt tokens the replica computed that its prefix cache did not hold, since it
    started (vLLM's prefix-cache queries less hits), as last scraped; None unknown."""
    scrape = replica.scrape
    if scrape is None or scrape.prefix_queries is None:
        return None
    return scrape.prefix_queries - (scrape.prefix_hits or 0.0)


def endpoints_of(replica: Replica, settings: KvEventsConfig) -> tuple[str, str | None]:
    """Where `replica` publishes: its own `kv_events` endpoints, else its URL's host at the
    pool's ports."""
    own = replica.config.kv_events
    if own is not None:
        return own.endpoint, own.replay_endpoint
    host = urlsplit(replica.url).hostname or "localhost"
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    replay = None if settings.replay_port is None else f"tcp://{host}:{settings.replay_port}"
    return f"tcp://{host}:{settings.port}", replay


@dataclass(slots=True)
class _Running:
    subscriber: Subscriber
    task: asyncio.Task[None]
    where: tuple[str, str | None, KvEventsConfig]


class KvEvents:
    """A subscriber for every replica whose pool has `kv_events`, and each one's index."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self._running: dict[str, _Running] = {}
        self.states: dict[str, ReplicaEvents] = {}
        self._last_keys: LazyKeys | None = None

    def index(self, replica_id: str) -> BlockIndex | None:
        """The replica's index, while it can be trusted; None without one."""
        state = self.states.get(replica_id)
        return None if state is None or state.sequencer.last is None else state.index

    def cached_blocks(self, replica_id: str, prompt: LazyKeys) -> int | None:
        """How many of the prompt's leading blocks the replica holds, or is about to (a
        prompt sent there in the last EXPECTED_S); None where its index is not trusted."""
        state = self.states.get(replica_id)
        if state is None or state.sequencer.last is None:
            return None
        state.forget_expected(self.clock())
        return state.leading(prompt)

    def keys_for(self, token_ids: Sequence[int], block_size: int) -> LazyKeys:
        """The prompt's block keys, the same object for the same prompt as long as it is the
        latest asked about: a request's ranking asks for them from two plugins, and again on
        each placement attempt, and each key is hashed once."""
        last = self._last_keys
        if last is None or last.tokens is not token_ids or last.size != block_size:
            last = self._last_keys = LazyKeys(token_ids, block_size)
        return last

    def tells_apart(self, replica_ids: Iterable[str], token_ids: Sequence[int], block_size: int) -> bool:
        """Some of the replicas hold more of the prompt than others (their indexes trusted)."""
        prompt = self.keys_for(token_ids, block_size)
        held = {self.cached_blocks(r, prompt) for r in replica_ids} - {None}
        return len(held) > 1

    def expect(self, replica_id: str, token_ids: tuple[int, ...] | None, block_size: int) -> None:
        """A prompt is being sent to the replica: count its blocks as cached there until its
        events arrive (or EXPECTED_S)."""
        state = self.states.get(replica_id)
        if state is None or not token_ids or state.sequencer.last is None:
            return
        state.forget_expected(self.clock())
        while len(state.expiries) >= EXPECTED_PROMPTS:  # the oldest go first
            state.forget_expected(state.expiries[0][0])
        keys = self.keys_for(token_ids, block_size).first(EXPECTED_BLOCKS)  # made once
        state.expected.update(keys)
        state.expiries.append((self.clock() + EXPECTED_S, keys))

    def sync(self, registry: Iterable[Replica], config: Config) -> None:
        """Start, restart and stop subscribers to match the fleet and its config; drop the
        index of a replica that failed its health check or has gone silent (`_untrusted`)."""
        wanted: dict[str, tuple[Replica, tuple[str, str | None, KvEventsConfig]]] = {}
        for replica in registry:
            pool = config.pools.get(replica.pool)
            settings = None if pool is None else pool.kv_events
            if settings is not None:
                wanted[replica.id] = (replica, (*endpoints_of(replica, settings), settings))
        for replica_id in [r for r in {*self._running, *self.states} if r not in wanted]:
            self._stop(replica_id)
            self.states.pop(replica_id, None)
        now = self.clock()
        for replica_id, (replica, where) in wanted.items():
            running = self._running.get(replica_id)
            if running is not None and running.where != where:
                self._stop(replica_id)
                running = None
            state = self.states.get(replica_id)
            misses = cache_misses(replica)
            if state is not None:
                state.saw(misses)
            started = None if replica.scrape is None else replica.scrape.started_at
            reason = None
            if state is not None and self._untrusted(replica, state, misses, where[2], now):
                reason = "silent" if replica.healthy else "unhealthy"
            elif state is not None and started is not None and started != (
                state.engine_started_at or started
            ):  # a new engine: its sequence numbers may have passed the old ones unseen
                reason = "restarted"
            if reason is not None:
                self._stop(replica_id)
                self.metrics.kv_events_resets.labels(replica_id, reason).inc()
                state = running = None
            if state is None:
                settings = where[2]
                hashes = None if settings.block_hash is None else engine_hashes(
                    settings.block_hash, settings.hash_seed)
                state = self.states[replica_id] = ReplicaEvents(
                    BlockIndex(replica.num_gpu_blocks or UNKNOWN_CAPACITY),
                    None if hashes is None else EngineMatch(hashes, replica_id))
            elif replica.num_gpu_blocks and state.index.capacity != replica.num_gpu_blocks:
                state.index.resize(replica.num_gpu_blocks)  # discovery learned it since
            state.engine_started_at = started or state.engine_started_at
            if running is None and replica.healthy:
                endpoint, replay, settings = where
                subscriber = Subscriber(replica_id, replica.pool, endpoint, replay, settings,
                                        state, self.metrics)
                task = asyncio.get_running_loop().create_task(
                    subscriber.run(), name=f"kv-events-{replica_id}")
                self._running[replica_id] = _Running(subscriber, task, where)
        for replica_id, state in self.states.items():
            self.metrics.kv_index_blocks.labels(replica_id).set(len(state.index))

    def _untrusted(
        self, replica: Replica, state: ReplicaEvents, misses: float | None,
        settings: KvEventsConfig, now: float,
    ) -> bool:
        """Failed its health check; or silent: nothing published for `silent_after_s` while
        its prompts missed its cache (`misses`, now) by SILENT_MISSED_TOKENS or more since
        the last batch (tokens it computed and must have stored). A replica serving cached
        prompts publishes nothing, and is not silent; one whose counters are unknown is
        judged by its health alone."""
        if not replica.healthy:
            return state.sequencer.last is not None or replica.id in self._running
        silent_since, before = state.last_event_at, state.misses_at_event
        return (
            misses is not None and before is not None and silent_since is not None
            and misses - before >= SILENT_MISSED_TOKENS
            and now - silent_since > settings.silent_after_s
        )

    def _stop(self, replica_id: str) -> None:
        running = self._running.pop(replica_id, None)
        if running is not None:
            running.task.cancel()
        state = self.states.get(replica_id)
        if state is not None:
            state.index.clear()
            self.states.pop(replica_id)

    async def close(self) -> None:
        tasks = [r.task for r in self._running.values()]
        for replica_id in list(self._running):
            self._stop(replica_id)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def describe(self, replica_id: str) -> dict[str, Any] | None:
        """For /admin/replicas: None where the replica's pool has no events."""
        state = self.states.get(replica_id)
        if state is None:
            return None
        age = None if state.last_event_at is None else round(self.clock() - state.last_event_at, 3)
        return {"subscribed": replica_id in self._running, "last_seq": state.sequencer.last,
                "blocks": len(state.index), "orphan_blocks": state.index.orphans,
                "partial": state.index.partial,
                "engine_hashes": None if state.engine is None else state.engine.agrees,
                "batches": state.batches, "gaps": state.gaps, "resets": state.resets,
                "last_event_age_s": age}


async def kv_events_loop(
    events: KvEvents, registry: Registry, current: Callable[[], Config]
) -> None:
    """Keep the subscribers in step with the fleet each discovery interval, until cancelled."""
    try:
        while True:
            events.sync(registry, current())
            await pause(lambda: current().discovery.interval_s)
    finally:
        await events.close()
