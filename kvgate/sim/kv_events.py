"""vLLM's KV cache events, as a replica publishes them: what its prefix cache stores and evicts.

A vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", ...}'` publishes, after each engine step that changed the cache, one `KVEventBatch`:

- on a ZMQ PUB socket (`endpoint`), three frames: the topic, an 8-byte big-endian sequence
  number (0 for the first batch after the engine starts), and the batch as msgpack;
- the batch is an array (timestamp, events); each event a map tagged by its class name under
  "type": `BlockStored` (the hashes of blocks that just filled, their parent's hash, their
  token ids, the block size...), `BlockRemoved` (hashes evicted) or `AllBlocksCleared`;
- on a ROUTER socket (`replay_endpoint`), a request of (identity, "", 8-byte start sequence
  number) is answered with every batch still buffered from that number, as (identity, "",
  topic, sequence number, payload), then an end marker whose sequence number is -1.

The structs here mirror `vllm/distributed/kv_events.py` field for field (the conformance
suite decodes this stream with vLLM's own classes); the simulator's block hashes are its own
and are only opaque ids to a subscriber, as vLLM's are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvgate.fleet.kv_wire import rank_endpoint

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BIND_ATTEMPTS = 100
MEDIUM_GPU = "GPU"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change of the prefix cache (tagged by class name under "type", as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVCacheEvent]  # vLLM's KVEventBatch narrows it to the three kinds
    data_parallel_rank: int | None = None


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `--kv-events-config`, the fields the simulator honours (a port of 0 binds a free
    port, kept across engine restarts)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """The flag's JSON; None when events are off (no flag, disabled, or the null
        publisher). Raises ValueError naming what is wrong."""
        if not text:
            return None
        try:
            config = msgspec.convert(json.loads(text), cls)
        except (ValueError, msgspec.ValidationError) as exc:
            raise ValueError(f"kv_events_config: {exc}") from None
        if config.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv_events_config: publisher {config.publisher!r} is not zmq or null")
        if config.buffer_steps < 1:
            raise ValueError("kv_events_config: buffer_steps must be >= 1")
        if not config.enable_kv_cache_events or config.publisher == "null":
            return None
        return config


def _bind_address(endpoint: str) -> str:
    """vLLM binds `tcp://*:port`; the simulator binds the loopback for `*` (it serves tests
    and benchmarks on one machine), and port 0 picks a free one."""
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:")


class Publisher:
    """The PUB socket, the replay buffer and the ROUTER socket that serves it. One per engine
    run: a restarted engine publishes from sequence number 0 again, on the same ports. A
    data-parallel rank publishes at the configured ports + its rank, as vLLM's does."""

    def __init__(self, config: KVEventsConfig, rank: int = 0) -> None:
        self.config, self.rank = config, rank
        self._ctx = zmq.asyncio.Context.instance()
        # PUB is a plain socket: a send never blocks (past its high-water mark it drops), and
        # an asyncio socket's send would leave a future per batch that nobody awaits
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._topic = config.topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._replays: asyncio.Task[None] | None = None

    async def open(self, bound: dict[str, str] | None = None) -> None:
        """Bind the sockets (`bound`: the endpoints a previous run bound, to bind the same
        ports again) and serve replays."""
        config, previous = self.config, bound or {}
        self._pub = zmq.Context.instance().socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = await self._bind(
            self._pub, previous.get("endpoint", rank_endpoint(config.endpoint, self.rank)))
        if config.replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = await self._bind(
                self._router,
                previous.get("replay_endpoint", rank_endpoint(config.replay_endpoint, self.rank)),
            )
            self._replays = asyncio.get_running_loop().create_task(
                self._serve_replays(), name="sim-kv-events-replay"
            )

    @staticmethod
    async def _bind(socket: zmq.Socket[bytes] | zmq.asyncio.Socket, endpoint: str) -> str:
        """Bind `endpoint` (port 0: a free one); the port a closed run of the engine held may
        take ZMQ's I/O thread a moment to let go of."""
        address = _bind_address(endpoint)
        if address.endswith(":0"):
            port = socket.bind_to_random_port(address.rsplit(":", 1)[0])
            return f"{address.rsplit(':', 1)[0]}:{port}"
        for attempt in range(BIND_ATTEMPTS):
            try:
                socket.bind(address)
                return address
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or attempt == BIND_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.02)
        raise AssertionError("unreachable")

    @property
    def bound(self) -> dict[str, str]:
        assert self.endpoint is not None
        ports = {"endpoint": self.endpoint}
        if self.replay_endpoint is not None:
            ports["replay_endpoint"] = self.replay_endpoint
        return ports

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One engine step's events as one batch (none: nothing is sent)."""
        if not events or self._pub is None:
            return
        seq, self._seq = self._seq, self._seq + 1
        # annotated with the engine's data-parallel rank, as vLLM's publisher does
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        payload = self._encode(batch)
        self._buffer.append((seq, payload))
        # PUB never blocks: past its high-water mark a slow subscriber loses batches (and
        # asks the replay socket for them), as with vLLM
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    async def _serve_replays(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3:
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._router.send_multipart(
                        (identity, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._router.send_multipart((identity, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        task, self._replays = self._replays, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for socket in (self._pub, self._router):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._router = None
