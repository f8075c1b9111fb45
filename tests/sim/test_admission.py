"""vLLM's own queue limits (`--max-num-queued-reqs`, `--max-num-queued-tokens`): the 503 with
vLLM's body once the queue passes a limit, counted in `vllm:admission_rejections`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest

from kvgate.sim.admission import MESSAGES
from kvgate.sim.config import SimConfig
from kvgate.sim.server import SimReplica
from tests.plugins import bodies
from tests.plugins.bodies import OMIT
from tests.plugins.sim import SimFactory
from tests.plugins.waiting import eventually
from tests.sim.helpers import ok, post, scrape

# Each step is slept out 1000x: a request sent stays in prefill (no token yet) for seconds.
FROZEN = {"time_scale": 1000.0, "num_gpu_blocks": 256, "max_model_len": 1024}
# Real time: a long answer decodes for seconds, one token every ~6 ms.
SLOW = {"time_scale": 1.0, "num_gpu_blocks": 256, "max_model_len": 2048}


def chat(content: str, max_tokens: int = 1000, **extra: Any) -> dict[str, Any]:
    return bodies.chat(content, model=OMIT, max_tokens=max_tokens, **extra)


def rejections(families: dict[str, Any], reason: str) -> float:
    (sample,) = [
        s for s in families["vllm:admission_rejections"].samples
        if s.name == "vllm:admission_rejections_total" and s.labels["reason"] == reason
    ]
    assert sample.labels == {"model_name": "sim-model", "reason": reason}  # no `engine`
    return float(sample.value)


@asynccontextmanager
async def in_flight(
    http: aiohttp.ClientSession, replica: SimReplica, body: dict[str, Any], *, first_token: bool
) -> AsyncIterator[None]:
    """A streamed request held open: once the engine has it (and, with `first_token`, once
    its first token reached us); hung up on leaving."""
    before = len(replica.engine.requests)
    response = await http.post(replica.url + "/v1/chat/completions", json={**body, "stream": True})
    try:
        assert response.status == 200
        await response.content.readuntil(b"\n\n")  # the role chunk
        if first_token:
            await response.content.readuntil(b"\n\n")
        await eventually(lambda: len(replica.engine.requests) > before)
        yield
    finally:
        response.close()


async def test_beyond_max_num_queued_reqs_the_replica_answers_vllms_503_and_counts_it(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(**SLOW, max_num_queued_reqs=2)
    async with in_flight(http, replica, chat("one"), first_token=True), \
            in_flight(http, replica, chat("two"), first_token=False):  # fmt: skip
        async with http.post(replica.url + "/v1/chat/completions", json=chat("three")) as r:
            assert r.status == 503
            assert "Retry-After" not in r.headers
            assert orjson.loads(await r.read()) == {"error": {
                "message": MESSAGES["max_num_queued_reqs"], "type": "Service Unavailable",
                "param": None, "code": 503,
            }}
        status, answer = await post(http, replica, "/v1/completions", {"prompt": "x", "stream": True})
        assert status == 503 and answer["error"]["code"] == 503  # a stream is refused before it starts
    families = await scrape(http, replica)
    assert rejections(families, "max_num_queued_reqs") == 2
    assert rejections(families, "max_num_queued_tokens") == 0
    await eventually(lambda: not replica.engine.has_unfinished_requests())
    await ok(http, replica, "/v1/chat/completions", chat("room again", 2))


async def test_a_request_of_n_sequences_takes_n_places_under_max_num_queued_reqs(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(**SLOW, max_num_queued_reqs=3)
    async with in_flight(http, replica, chat("one"), first_token=True):
        status, answer = await post(http, replica, "/v1/chat/completions", chat("n=3", 2, n=3))
        assert status == 503 and answer["error"]["message"] == MESSAGES["max_num_queued_reqs"]
        answer = await ok(http, replica, "/v1/chat/completions", chat("n=2", 2, n=2))
        assert len(answer["choices"]) == 2
    assert rejections(await scrape(http, replica), "max_num_queued_reqs") == 1


async def test_max_num_queued_tokens_counts_prompts_until_their_first_token(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    # One running sequence at a time: the second request waits, in prefill, behind the first.
    replica = await sim_factory(**SLOW, max_num_seqs=1, max_num_queued_tokens=40)
    long_prompt = chat("word " * 100)
    async with in_flight(http, replica, long_prompt, first_token=True):
        # the first one decodes: its 100-token prompt no longer counts
        waiting = asyncio.ensure_future(
            post(http, replica, "/v1/chat/completions", chat("tell me " * 30, 2))
        )
        await eventually(lambda: len(replica.engine.waiting) == 1)
        status, answer = await post(http, replica, "/v1/chat/completions", chat("hi", 2))
        assert status == 503
        assert answer["error"]["message"] == MESSAGES["max_num_queued_tokens"]
        assert answer["error"]["type"] == "Service Unavailable"
    status, _ = await waiting  # runs once the first one is hung up on
    assert status == 200
    families = await scrape(http, replica)
    assert rejections(families, "max_num_queued_tokens") == 1
    assert rejections(families, "max_num_queued_reqs") == 0


async def test_each_sequence_of_an_n_request_counts_its_prompt_under_max_num_queued_tokens(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    plain = await sim_factory(**FROZEN)
    counted = await ok(http, plain, "/tokenize", {"messages": chat("same prompt")["messages"]})
    tokens = counted["count"]
    replica = await sim_factory(**FROZEN, max_num_queued_tokens=2 * tokens + 1)
    # one prompt in prefill is below the limit: the request of two sequences gets in
    async with in_flight(http, replica, chat("same prompt"), first_token=False), \
            in_flight(http, replica, chat("same prompt", n=2), first_token=False):  # fmt: skip
        status, _ = await post(http, replica, "/v1/chat/completions", chat("no room", 1))
        assert status == 503  # 3 × the prompt are in prefill now
    assert rejections(await scrape(http, replica), "max_num_queued_tokens") == 1


async def test_a_full_queue_answers_503_before_the_prompt_is_even_checked(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(**FROZEN, max_num_queued_reqs=0)
    status, answer = await post(http, replica, "/v1/chat/completions", chat("x " * 5000, 5000))
    assert status == 503 and answer["error"]["code"] == 503  # not the context-length 400


async def test_a_prompt_list_is_refused_once_its_later_prompts_overflow_the_queue(
    sim_factory: SimFactory, http: aiohttp.ClientSession
) -> None:
    replica = await sim_factory(**FROZEN, max_num_queued_reqs=2)
    status, answer = await post(
        http, replica, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1}
    )
    assert status == 503 and answer["error"]["message"] == MESSAGES["max_num_queued_reqs"]
    assert not replica.engine.has_unfinished_requests()  # the prompts added first were aborted
    assert rejections(await scrape(http, replica), "max_num_queued_reqs") == 1


def test_queue_limits_are_null_or_at_least_zero() -> None:
    assert SimConfig(max_num_queued_reqs=0, max_num_queued_tokens=0).max_num_queued_reqs == 0
    with pytest.raises(ValueError, match="max_num_queued_reqs: must be >= 0"):
        SimConfig(max_num_queued_reqs=-1)
    with pytest.raises(ValueError, match="max_num_queued_tokens: must be >= 0"):
        SimConfig.from_mapping({"max_num_queued_tokens": -5})
    config = SimConfig.from_mapping({"max_num_queued_reqs": None, "max_num_queued_tokens": 64})
    assert (config.max_num_queued_reqs, config.max_num_queued_tokens) == (None, 64)
