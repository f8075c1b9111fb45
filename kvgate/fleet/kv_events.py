"""What each replica really caches, from vLLM's KV cache events: the fleet of subscribers
(`kvgate.fleet.kv_subscriber`), one per replica, or per data-parallel rank of a replica whose
/metrics shows several engines (each rank publishes at the ports + its rank).

`KvEvents` keeps a subscriber for every replica of a pool with `kv_events` configured, and
drops the index of a replica that fails its health check, leaves the fleet, or publishes
nothing for `silent_after_s` while its prompts miss its cache. A replica holds what its
deepest rank holds; where its ranks tell a prompt apart, the request is pinned to that rank
(`rank_for`: vLLM's `X-data-parallel-rank`), otherwise vLLM's own balancing picks one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvgate.config import Config, KvEventsConfig
from kvgate.fleet.block_index import BlockIndex, LazyKeys
from kvgate.fleet.engine_hash import EngineMatch, engine_hashes
from kvgate.fleet.kv_subscriber import ReplicaEvents, Subscriber
from kvgate.fleet.kv_wire import rank_endpoint
from kvgate.fleet.replicas import Registry, Replica
from kvgate.intervals import pause
from kvgate.metrics import Metrics

# A prompt sent to a replica counts as cached there this long, or until its events say so:
# a burst of requests for one new document would otherwise all be placed before the first
# one's blocks are published, each on whichever replica its fingerprint picks.
EXPECTED_S = 10.0
EXPECTED_BLOCKS = 2048  # of a prompt's leading blocks, at most, are expected
EXPECTED_PROMPTS = 1024  # prompts expected at once per replica, at most
# The index's bound until discovery knows the replica's own number of blocks.
UNKNOWN_CAPACITY = 1 << 20
# Prompt tokens a replica may compute uncached without publishing, before it counts as silent
# (64 blocks of 16: vLLM stores every full block it computes)
SILENT_MISSED_TOKENS = 1024
Where = tuple[str, str | None, KvEventsConfig]  # endpoint, replay endpoint, settings


def stream_name(replica_id: str, rank: int) -> str:
    """A stream's name in `KvEvents.states` and in metrics: the replica's id for rank 0, and
    `<id>/dp<rank>` for another rank."""
    return replica_id if rank == 0 else f"{replica_id}/dp{rank}"


def cache_misses(replica: Replica) -> float | None:
    """Prompt tokens the replica computed that its prefix cache did not hold, since it
    started (vLLM's prefix-cache queries less hits), as last scraped; None unknown."""
    scrape = replica.scrape
    if scrape is None or scrape.prefix_queries is None:
        return None
    return scrape.prefix_queries - (scrape.prefix_hits or 0.0)


def endpoints_of(replica: Replica, settings: KvEventsConfig, rank: int = 0) -> tuple[str, str | None]:
    """Where `replica` (data-parallel rank `rank` of it) publishes: its own `kv_events`
    endpoints, else its URL's host at the pool's ports; either at the ports + the rank."""
    own = replica.config.kv_events
    if own is not None:
        endpoint, replay = own.endpoint, own.replay_endpoint
    else:
        host = urlsplit(replica.url).hostname or "localhost"
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        endpoint = f"tcp://{host}:{settings.port}"
        replay = None if settings.replay_port is None else f"tcp://{host}:{settings.replay_port}"
    return rank_endpoint(endpoint, rank), None if replay is None else rank_endpoint(replay, rank)


def ranks_of(replica: Replica) -> tuple[int, ...]:
    """The replica's data-parallel ranks, as its /metrics names its engines (one: rank 0)."""
    return (replica.scrape.engines if replica.scrape is not None else ()) or (0,)


@dataclass(slots=True)
class _Running:
    task: asyncio.Task[None]  # the subscriber's run
    where: Where


class KvEvents:
    """A subscriber for every replica (every rank of it) whose pool has `kv_events`, and
    each one's index."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self._running: dict[str, _Running] = {}
        self.states: dict[str, ReplicaEvents] = {}  # by stream (`stream_name`)
        self._streams: dict[str, tuple[str, ...]] = {}  # each replica's, in rank order

    def index(self, stream: str) -> BlockIndex | None:
        """A stream's index (a replica's, for rank 0), while it can be trusted; else None."""
        state = self.states.get(stream)
        return None if state is None or state.sequencer.last is None else state.index

    def _trusted(self, replica_id: str) -> list[ReplicaEvents]:
        states = (self.states.get(s) for s in self._streams.get(replica_id, (replica_id,)))
        return [state for state in states if state is not None and state.sequencer.last is not None]

    def _held(self, replica_id: str, prompt: LazyKeys) -> list[tuple[int, ReplicaEvents]]:
        now = self.clock()
        held = []
        for state in self._trusted(replica_id):
            state.forget_expected(now)
            held.append((state.leading(prompt), state))
        return held

    def cached_blocks(self, replica_id: str, prompt: LazyKeys) -> int | None:
        """How many of the prompt's leading blocks the replica holds, or is about to (a
        prompt sent there in the last EXPECTED_S), on its deepest rank; None where no index
        of it is trusted."""
        held = self._held(replica_id, prompt)
        return max(count for count, _ in held) if held else None

    def rank_for(self, replica_id: str, prompt: LazyKeys | None) -> int | None:
        """Where the replica has several data-parallel engines and one holds more of the
        prompt than the others: that engine, as vLLM's `X-data-parallel-rank` names it (its
        place among the server's engines, in rank order: its rank, unless the server's first
        is not rank 0). None: vLLM's own balancing picks (the engines hold the prompt alike,
        or nothing is known of them)."""
        streams = self._streams.get(replica_id, ())
        if prompt is None or not prompt.tokens or len(streams) < 2:
            return None
        held = sorted(self._held(replica_id, prompt),
                      key=lambda item: item[0], reverse=True)  # fmt: skip
        if not held or held[0][0] == 0 or (len(held) > 1 and held[1][0] == held[0][0]):
            return None
        return streams.index(held[0][1].stream)

    def expect(self, replica_id: str, prompt: LazyKeys | None, engine: int | None = None) -> None:
        """A prompt is being sent to the replica (pinned to `engine`, as `rank_for` names it,
        or to whichever engine vLLM picks: then each expects it, the replica will hold it on
        one): count its blocks as cached there until its events arrive (or EXPECTED_S)."""
        if prompt is None or not prompt.tokens:
            return
        states = self._trusted(replica_id)
        if engine is not None:
            pinned = self._streams[replica_id][engine]
            states = [state for state in states if state.stream == pinned]
        if not states:
            return
        keys = prompt.first(EXPECTED_BLOCKS)  # made once
        now = self.clock()
        for state in states:
            state.forget_expected(now)
            while len(state.expiries) >= EXPECTED_PROMPTS:  # the oldest go first
                state.forget_expected(state.expiries[0][0])
            state.expected.update(keys)
            state.expiries.append((now + EXPECTED_S, keys))

    def sync(self, registry: Iterable[Replica], config: Config) -> None:
        """Start, restart and stop subscribers to match the fleet, its ranks and its config;
        drop the indexes of a replica that failed its health check or has gone silent
        (`_reason_to_drop`), or whose engine started again."""
        wanted: dict[str, tuple[Replica, int, Where]] = {}
        streams: dict[str, tuple[str, ...]] = {}
        for replica in registry:
            pool = config.pools.get(replica.pool)
            settings = None if pool is None else pool.kv_events
            if settings is None:
                continue
            ranks = ranks_of(replica)
            streams[replica.id] = tuple(stream_name(replica.id, rank) for rank in ranks)
            for rank in ranks:
                where = (*endpoints_of(replica, settings, rank), settings)
                wanted[stream_name(replica.id, rank)] = (replica, rank, where)
        for stream in [s for s in {*self._running, *self.states} if s not in wanted]:
            self._stop(stream)
        self._streams = streams
        now = self.clock()
        for names in streams.values():
            replica, _, (_, _, settings) = wanted[names[0]]
            states = [self.states.get(n) for n in names]
            reason = self._reason_to_drop(replica, states, settings, now)
            for name in names:
                _, rank, where = wanted[name]
                if reason is not None and name in self.states:
                    self._stop(name)
                    self.metrics.kv_events_resets.labels(name, reason).inc()
                self._keep(name, replica, rank, where, len(names))
        for stream, state in self.states.items():
            self.metrics.kv_index_blocks.labels(stream).set(len(state.index))

    def _reason_to_drop(
        self, replica: Replica, states: list[ReplicaEvents | None], settings: KvEventsConfig,
        now: float,
    ) -> str | None:
        """Why the replica's indexes can no longer be trusted, or None: failed its health
        check; silent (`_silent`, judged over all its ranks); a new engine, whose sequence
        numbers may have passed the old ones unseen."""
        known = [state for state in states if state is not None]
        if not known:
            return None
        misses = cache_misses(replica)
        for state in known:
            state.saw(misses)
        if not replica.healthy:
            subscribed = any(s.sequencer.last is not None for s in known) or any(
                s.stream in self._running for s in known)
            return "unhealthy" if subscribed else None
        if _silent(known, misses, settings.silent_after_s, now):
            return "silent"
        started = None if replica.scrape is None else replica.scrape.started_at
        if started is not None and any(started != (s.engine_started_at or started) for s in known):
            return "restarted"
        return None

    def _keep(self, stream: str, replica: Replica, rank: int, where: Where, ranks: int) -> None:
        """The stream's state, made where there is none (bounded by its rank's share of the
        replica's blocks), and its subscriber, started where none runs and the replica is
        healthy (a changed endpoint: started again)."""
        running = self._running.get(stream)
        if running is not None and running.where != where:
            self._stop(stream)
            running = None
        state = self.states.get(stream)
        capacity = (replica.num_gpu_blocks or 0) // ranks
        settings = where[2]
        if state is None:
            hashes = None if settings.block_hash is None else engine_hashes(
                settings.block_hash, settings.hash_seed)
            state = self.states[stream] = ReplicaEvents(
                BlockIndex(capacity or UNKNOWN_CAPACITY),
                None if hashes is None else EngineMatch(hashes, stream), stream=stream, rank=rank)
        elif capacity and state.index.capacity != capacity:
            state.index.resize(capacity)  # discovery learned it since
        started = None if replica.scrape is None else replica.scrape.started_at
        state.engine_started_at = started or state.engine_started_at
        if running is None and replica.healthy:
            endpoint, replay, _ = where
            subscriber = Subscriber(stream, endpoint, replay, settings, state, self.metrics)
            task = asyncio.get_running_loop().create_task(
                subscriber.run(), name=f"kv-events-{stream}")
            self._running[stream] = _Running(task, where)

    def _stop(self, stream: str) -> None:
        running = self._running.pop(stream, None)
        if running is not None:
            running.task.cancel()
        state = self.states.pop(stream, None)
        if state is not None:
            state.index.clear()

    async def close(self) -> None:
        tasks = [r.task for r in self._running.values()]
        for stream in list(self._running):
            self._stop(stream)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def describe(self, replica_id: str) -> dict[str, Any] | None:
        """For /admin/replicas: None where the replica's pool has no events; with several
        ranks, each rank's under `ranks`."""
        names = [n for n in self._streams.get(replica_id, (replica_id,)) if n in self.states]
        if not names:
            return None
        if len(names) == 1:
            return self._describe(names[0])
        ranks = {str(self.states[n].rank): self._describe(n) for n in names}
        return {"subscribed": all(r["subscribed"] for r in ranks.values()),
                "blocks": sum(r["blocks"] for r in ranks.values()),
                "partial": any(r["partial"] for r in ranks.values()), "ranks": ranks}

    def _describe(self, stream: str) -> dict[str, Any]:
        state, running = self.states[stream], self._running.get(stream)
        age = None if state.last_event_at is None else round(self.clock() - state.last_event_at, 3)
        return {"subscribed": running is not None,
                "endpoint": None if running is None else running.where[0],
                "last_seq": state.sequencer.last,
                "blocks": len(state.index), "orphan_blocks": state.index.orphans,
                "partial": state.index.partial,
                "engine_hashes": None if state.engine is None else state.engine.agrees,
                "batches": state.batches, "gaps": state.gaps, "resets": state.resets,
                "last_event_age_s": age}


def _silent(
    states: list[ReplicaEvents], misses: float | None, silent_after_s: float, now: float
) -> bool:
    """Nothing published on any of a replica's streams for `silent_after_s` while its prompts
    missed its cache (`misses`, now) by SILENT_MISSED_TOKENS or more since the last batch
    (tokens it computed and must have stored). A replica serving cached prompts publishes
    nothing, and is not silent; one whose counters are unknown is judged by its health
    alone."""
    latest = max(states, key=lambda s: s.last_event_at or 0.0)
    silent_since, before = latest.last_event_at, latest.misses_at_event
    return (
        misses is not None and before is not None and silent_since is not None
        and misses - before >= SILENT_MISSED_TOKENS and now - silent_since > silent_after_s
    )


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
