"""The critical class keeps headroom of its own: a bulk tenant's burst fills a replica up to
the rest, and a critical request arriving behind it starts at once, without queueing."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import aiohttp

from tests.plugins.bodies import SIM_MODEL, chat
from tests.plugins.gateway import gateway_config, wait_settled

RULE = "occupancy"
SIM = dict(num_gpu_blocks=400, max_model_len=4096, max_num_seqs=128, time_scale=0.01,
           output_len_dist="lognormal", output_len_median_fraction=0.2, output_len_sigma=0.3)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def body(i: int, max_tokens: int = 512) -> dict[str, Any]:
    return chat(f"Extract the orders of batch {i}.", model=SIM_MODEL, max_tokens=max_tokens)


def config(sim_url: str, headroom: float) -> Any:
    return gateway_config(
        [sim_url],
        auth={"mode": "api_key"},
        tenants=[{"name": "bulk", "api_key_sha256": [sha("sk-bulk")], "priority": "sheddable"},
                 {"name": "vip", "api_key_sha256": [sha("sk-vip")], "priority": "critical"}],
        # max_replica_waiting: the hold on a replica whose own vLLM queue is long holds every
        # class alike (tests/admission/test_admission.py); on a loaded machine the burst can
        # leave the simulator a queue for a scrape or two, and the critical request would wait
        # for that, not for blocks. Here only the ledger's headroom decides.
        admission={"critical_headroom": headroom, "prediction": {"rule": RULE},
                   "max_replica_waiting": 10_000,
                   "queue": {"max_wait_s": 120, "wait_budget_s": {"sheddable": 120}}},
    )


async def burst_then_critical(gw: Any) -> tuple[int, float]:
    """Bulk's burst, then three critical requests while it runs: how many bulk requests were
    waiting when the critical ones arrived, and the critical class's total queue wait."""
    admission = gw.gateway.admission
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one(key: str, i: int, max_tokens: int = 512) -> None:
            async with session.post(f"{gw.url}/v1/chat/completions", json=body(i, max_tokens),
                                    headers={"Authorization": f"Bearer {key}"}) as r:  # fmt: skip
                assert r.status == 200, await r.text()
                await r.read()

        await asyncio.gather(*(one("sk-bulk", i) for i in range(16)))  # lengths become known
        bulk = [asyncio.create_task(one("sk-bulk", 100 + i)) for i in range(150)]
        while not len(admission.pool("default").queue):  # noqa: ASYNC110 (polls state)
            await asyncio.sleep(0.005)
        waiting = len(admission.pool("default").queue)
        await asyncio.gather(*(one("sk-vip", 900 + i, 64) for i in range(3)))
        await asyncio.gather(*bulk)
    wait = gw.gateway.metrics.queue_wait.labels("default", "critical")
    return waiting, _histogram_sum(wait)


def _histogram_sum(child: Any) -> float:
    return next(s.value for m in child.collect() for s in m.samples if s.name.endswith("_sum"))


async def test_a_critical_request_behind_a_bulk_burst_starts_without_queueing(
    sim_factory, gateway_factory
):
    sim = await sim_factory(**SIM)
    gw = await gateway_factory(config(sim.url, headroom=0.1))
    waiting, critical_wait = await burst_then_critical(gw)
    await wait_settled(gw)
    assert waiting > 0  # the burst filled what bulk may use
    assert critical_wait == 0.0  # none of the critical requests queued


async def test_without_kept_headroom_the_critical_request_queues_behind_the_burst(
    sim_factory, gateway_factory
):
    """The same run with no headroom kept: what the setting is for."""
    sim = await sim_factory(**SIM)
    gw = await gateway_factory(config(sim.url, headroom=0.0))
    waiting, critical_wait = await burst_then_critical(gw)
    await wait_settled(gw)
    assert waiting > 0
    assert critical_wait > 0.0
