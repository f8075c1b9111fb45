"""A tenant pays for what the replica processed, however the request ends.

Measured against the simulator's own counters of prompt and generated tokens: a completed
request, a stream the client leaves midway, and a non-streamed request the client gives up on
(kvgate cannot get its usage, so it charges what the replica's decode clock — its generation
counter per running sequence, read from its /metrics after the answer ended — advanced while
the request was there; before this, the whole charge was refunded and timing out beat the
budget).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.plugins.bodies import SIM_MODEL, chat
from tests.plugins.gateway import gateway_config, wait_settled
from tests.tenants.support import metrics, sample

PROMPT = [
    {"role": "system", "content": "You are a careful assistant. " * 20},
    {"role": "user", "content": "Write a long essay about block allocation."},
]


def body(max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return chat(model=SIM_MODEL, messages=PROMPT, max_tokens=max_tokens, ignore_eos=True,
                stream=stream)


async def charged_tokens(session: aiohttp.ClientSession, url: str) -> float:
    samples = await metrics(session, url)
    return sum(sample(samples, "kvgate_tenant_tokens_total", tenant="team", kind=kind) or 0.0
               for kind in ("prompt", "completion"))


async def completion_tokens(session: aiohttp.ClientSession, url: str) -> float:
    samples = await metrics(session, url)
    return sample(samples, "kvgate_tenant_tokens_total", tenant="team", kind="completion") or 0.0


class Books:
    """The tenant's charge and the replica's processed tokens, before and after one request."""

    def __init__(self, session: aiohttp.ClientSession, gw: Any, sim: Any) -> None:
        self.session, self.gw, self.sim = session, gw, sim

    def processed(self) -> int:
        stats = self.sim.engine.stats
        return int(stats.prompt_tokens + stats.generation_tokens)

    async def around(self, request: Any) -> tuple[float, int]:
        charged, processed = await charged_tokens(self.session, self.gw.url), self.processed()
        await request
        await wait_settled(self.gw)
        await asyncio.sleep(0.05)  # the simulator's step that noticed the abort
        return (await charged_tokens(self.session, self.gw.url) - charged,
                self.processed() - processed)


@pytest.fixture
async def books(sim_factory, gateway_factory):
    # time_scale 1: one sequence decodes at ~160 tokens/s, slow enough to leave midway
    sim = await sim_factory(num_gpu_blocks=2048, max_model_len=4096, time_scale=1.0)
    config = gateway_config(
        [sim.url], auth={"mode": "none", "anonymous_tenant": "team"},
        tenants=[{"name": "team", "tokens_per_minute": 1_000_000}],
    )
    gw = await gateway_factory(config)
    async with aiohttp.ClientSession() as session:
        yield Books(session, gw, sim)


async def completed(books: Books, max_tokens: int = 120) -> None:
    url = f"{books.gw.url}/v1/chat/completions"
    async with books.session.post(url, json=body(max_tokens)) as r:
        assert r.status == 200
        await r.read()


async def left_mid_stream(books: Books) -> None:
    url = f"{books.gw.url}/v1/chat/completions"
    async with books.session.post(url, json=body(2000, stream=True)) as r:
        assert r.status == 200
        for _ in range(60):
            await r.content.readuntil(b"\n\n")
        r.close()


async def abandoned(books: Books) -> None:
    url = f"{books.gw.url}/v1/chat/completions"
    with pytest.raises(TimeoutError):
        async with books.session.post(url, json=body(2000),
                                      timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            await r.read()


async def test_every_ending_is_charged_what_the_replica_processed(books):
    # The first completion also teaches kvgate the replica's pace.
    for ending in (completed, completed, left_mid_stream, abandoned):
        charged, processed = await books.around(ending(books))
        assert processed > 0
        print(f"{ending.__name__}: charged {charged:.0f}, processed {processed}")
        # An abandoned whole answer is charged the replica's own count of what it generated
        # (its decode clock, read after the answer ended): exact for a lone request. A stream
        # is charged the chunks relayed: the replica may compute a token or two more before
        # it sees the client go.
        tolerance = 0.01 if ending is abandoned else 0.05
        assert abs(charged - processed) <= tolerance * processed, (
            f"{ending.__name__}: charged {charged:.0f} tokens, the replica processed {processed}"
        )


@pytest.mark.parametrize("after_s", [0.3, 0.5, 1.0])
async def test_a_whole_answer_its_client_gave_up_on_is_charged_what_the_replica_generated(
    books, after_s
):
    """Within 1% of the tokens the simulator generated for that request, whenever the client
    leaves: a real-time simulator's pace drifts with the machine's load, so the charge must
    follow what the replica did for this request, not a pace seen earlier."""
    await books.around(completed(books))
    url = f"{books.gw.url}/v1/chat/completions"

    async def abandoned_after() -> None:
        with pytest.raises(TimeoutError):
            async with books.session.post(url, json=body(2000),
                                          timeout=aiohttp.ClientTimeout(total=after_s)) as r:
                await r.read()

    charged = await completion_tokens(books.session, books.gw.url)
    generated = books.sim.engine.stats.generation_tokens
    await books.around(abandoned_after())
    charged = await completion_tokens(books.session, books.gw.url) - charged
    generated = books.sim.engine.stats.generation_tokens - generated
    print(f"left after {after_s}s: charged {charged:.0f}, generated {generated}")
    assert generated > 0
    assert abs(charged - generated) <= 0.01 * generated, (charged, generated)


async def test_a_whole_answer_kvgate_stopped_waiting_for_is_charged_what_the_replica_did(
    sim_factory, gateway_factory
):
    """kvgate's own first-byte timeout ends a non-streamed request while the replica computes
    it: a 504 for the client, but not a free answer for the tenant."""
    sim = await sim_factory(num_gpu_blocks=2048, max_model_len=4096, time_scale=1.0)
    config = gateway_config(
        [sim.url], auth={"mode": "none", "anonymous_tenant": "team"},
        tenants=[{"name": "team", "tokens_per_minute": 1_000_000}],
        timeouts={"connect_s": 2, "first_byte_s": 1.0, "idle_s": 10, "total_s": 30},
    )
    gw = await gateway_factory(config)
    async with aiohttp.ClientSession() as session:
        books = Books(session, gw, sim)
        await books.around(completed(books, 30))  # the replica's pace, well within first_byte_s

        async def timed_out(books: Books) -> None:
            url = f"{books.gw.url}/v1/chat/completions"
            async with books.session.post(url, json=body(2000)) as r:
                assert r.status == 504

        charged, processed = await books.around(timed_out(books))
    assert abs(charged - processed) <= 0.05 * processed, (charged, processed)
