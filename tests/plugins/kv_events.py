"""A simulated replica's KV cache events, as tests read them: the simulator's settings with
events on, its replay socket read to the end, prompts sent and tokenized there; and a
subscriber joined to it (past ZMQ's slow joiner) and caught up with what it published."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from kvgate.fleet.kv_subscriber import ReplicaEvents
from kvgate.sim.server import SimReplica
from tests.plugins.waiting import eventually
from tests.sim.helpers import ok

EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                     "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})
SIM = {"time_scale": 0.001, "num_gpu_blocks": 64, "max_model_len": 512,
       "kv_events_config": EVENTS}


async def replay(replica: SimReplica, start: int = 0, raw: bool = False) -> list[tuple[int, Any]]:
    """Every batch the replica still buffers from `start`, up to the end marker: decoded, or
    as the bytes that came (`raw`)."""
    assert replica.kv_events_endpoints is not None
    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(replica.kv_events_endpoints["replay_endpoint"])
    try:
        await socket.send_multipart((b"", start.to_bytes(8, "big")))
        batches = []
        while True:
            async with asyncio.timeout(5):
                _, topic, seq, payload = await socket.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                assert (topic, payload) == (b"", b"")
                return batches
            assert topic == b"kv"
            batches.append((number, payload if raw else msgspec.msgpack.decode(payload)))
    finally:
        socket.close()


async def complete(http: aiohttp.ClientSession, replica: SimReplica, prompt: str) -> None:
    await ok(http, replica, "/v1/completions",
             {"model": "sim-model", "prompt": prompt, "max_tokens": 1})  # fmt: skip


async def tokens(http: aiohttp.ClientSession, replica: SimReplica, prompt: str) -> list[int]:
    return (await ok(http, replica, "/tokenize", {"model": "sim-model", "prompt": prompt}))["tokens"]


PROMPT = " ".join(f"word{i}" for i in range(60))
ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You answer questions about the document the user gives, from it alone."
# the simulator's model as kvgate must know it to count a chat's token ids exactly: its
# ChatML template and markers
SIM_CHATML = {"name": "sim-model", "tokenizer": {
    "kind": "tiktoken", "template_file": str(ROOT / "config" / "sim-chatml.jinja"),
    "special_tokens": {"<|im_start|>": 100264, "<|im_end|>": 100265}}}


def document_chat(document: int, question: object, clauses: int = 120, **fields: Any) -> dict[str, Any]:
    """A chat about document `document` (`clauses` words: 120 are about 25 blocks of 16)
    under the shared system prompt; `fields` over max_tokens 4."""
    text = " ".join(f"clause{document}-{i}" for i in range(clauses))
    return {"model": "sim-model", "max_tokens": 4, **fields, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Document {document}:\n{text}\n\nQuestion: {question}"},
    ]}  # fmt: skip


async def joined(
    http: aiohttp.ClientSession, replica: SimReplica, state: ReplicaEvents,
    publish: Callable[[], Awaitable[object]] | None = None,
) -> None:
    """Until the subscriber hears the replica, publishing a batch at each try: by default an
    empty cache's reset (an AllBlocksCleared, and nothing else changes). A SUB socket that has
    just connected loses what is published before its subscription reaches the publisher
    (ZMQ's slow joiner), and a test whose traffic all came before then would wait for a
    batch that never follows."""
    async def reset() -> None:
        async with http.post(f"{replica.url}/reset_prefix_cache") as response:
            assert (await response.json())["success"]

    async def heard() -> bool:
        if state.sequencer.last is None:
            await (publish or reset)()
        return state.sequencer.last is not None

    await eventually(heard, what="the subscriber heard the replica", interval_s=0.05)


async def caught_up(replica: SimReplica, state: ReplicaEvents) -> None:
    async def done() -> bool:
        batches = await replay(replica)
        return bool(batches) and state.sequencer.last == batches[-1][0]

    await eventually(done, what="the subscriber caught up")
