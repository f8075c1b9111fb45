"""What subscribing to a replica's KV cache events costs kvgate: CPU of one core at a given
event rate, with the index kept.

A publisher process (the simulator's `Publisher`, vLLM's wire format) sends `--rate` events a
second in batches of `--batch` (a vLLM step that stores a few blocks per request is a batch):
each event a BlockStored of one 16-token block chained from the last, with now and then a
BlockRemoved of an old one, as a replica under load stores and evicts. This process runs one
`Subscriber` into a `BlockIndex` and measures its own CPU time (`time.process_time`) over
`--seconds`; the figure is that over wall time, in % of one core, beside how many events it
applied (all of them, or it fell behind). `--layout arrays` publishes each event as an array
led by its tag, as vLLM 0.10 (which deploy/k8s pins) did; `maps` (default) as tagged maps, as
vLLM does today.

    .venv/bin/python bench/kv_events.py [--rate 10000] [--batch 20] [--seconds 10] [--layout maps]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.config import KvEventsConfig
from kvgate.fleet.block_index import BlockIndex
from kvgate.fleet.kv_subscriber import ReplicaEvents, Subscriber
from kvgate.fleet.kv_wire import FIELDS
from kvgate.metrics import Metrics
from kvgate.sim import kv_events as sim_events


def as_arrays(batch: sim_events.KVEventBatch) -> bytes:
    """A batch as vLLM 0.10 encoded it: each event an array led by its tag, trailing defaults
    left out."""
    events = []
    for event in batch.events:
        tag = type(event).__name__
        values = [getattr(event, name, None) for name in FIELDS[tag]]
        while values and values[-1] is None:
            values.pop()
        events.append([tag, *values])
    return msgspec.msgpack.encode([batch.ts, events, batch.data_parallel_rank])


def publish(endpoints: multiprocessing.Queue, rate: int, batch: int, seconds: float,  # type: ignore[type-arg]
            layout: str) -> None:  # fmt: skip
    async def run() -> None:
        config = sim_events.KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0",
                                           replay_endpoint="tcp://*:0", topic="kv")
        publisher = sim_events.Publisher(config)
        if layout == "arrays":
            publisher._encode = as_arrays  # the simulator publishes maps
        await publisher.open()
        endpoints.put(publisher.bound)
        await asyncio.sleep(1.0)  # the subscriber connects
        block, parent = 0, None
        start = time.monotonic()
        while time.monotonic() - start < seconds + 1:
            events: list[sim_events.KVCacheEvent] = []
            for _ in range(batch):
                if block % 10 == 9:
                    events.append(sim_events.BlockRemoved(block_hashes=[block - 500],
                                                          medium="GPU"))
                else:
                    events.append(sim_events.BlockStored(
                        block_hashes=[block], parent_block_hash=parent,
                        token_ids=list(range(block * 16, block * 16 + 16)), block_size=16,
                        lora_id=None, medium="GPU", lora_name=None))
                    parent = block
                block += 1
            publisher.publish(events)
            await asyncio.sleep(max(0.0, start + block / rate - time.monotonic()))
        await publisher.close()

    asyncio.run(run())


async def measure(rate: int, batch: int, seconds: float, layout: str) -> dict[str, Any]:
    endpoints: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    process = multiprocessing.Process(target=publish,
                                      args=(endpoints, rate, batch, seconds, layout))
    process.start()
    bound = await asyncio.to_thread(endpoints.get, True, 30)
    state = ReplicaEvents(BlockIndex(1_000_000))
    metrics = Metrics()
    subscriber = Subscriber("r0", bound["endpoint"], bound["replay_endpoint"],
                            KvEventsConfig(), state, metrics)
    task = asyncio.create_task(subscriber.run())
    while state.sequencer.last is None:  # noqa: ASYNC110 (polls the subscriber's state)
        await asyncio.sleep(0.01)
    applied, cpu, wall = state.batches, time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    batches = state.batches - applied
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    process.join(timeout=10)
    return {"layout": layout, "rate": rate, "batch": batch, "seconds": round(wall, 2),
            "events_per_s": round(batches * batch / wall), "cpu_percent_of_core": round(100 * cpu / wall, 2),
            "index_blocks": len(state.index), "gaps": state.gaps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--layout", choices=("maps", "arrays"), default="maps")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.rate, args.batch, args.seconds, args.layout))))


if __name__ == "__main__":
    main()
