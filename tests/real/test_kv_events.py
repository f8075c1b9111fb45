"""KV cache events from a real engine: decoded and indexed, its block hashes the ones kvgate
computes, a shared document routed to the replica that holds it, and an engine's restart
resetting what kvgate believes it holds."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvgate.fleet.block_index import block_keys
from kvgate.fleet.engine_hash import EngineHashes
from kvgate.tools.tiny_model import MODEL_NAME
from tests.plugins import client
from tests.plugins.gateway import wait_released
from tests.plugins.waiting import eventually
from tests.real.conftest import document_chat as chat
from tests.real.conftest import real_config, wait_idle

pytestmark = pytest.mark.timeout(240)



async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str | None:
    status, headers, raw = await client.post(f"{url}/v1/chat/completions", body, http=http)
    assert status == 200, raw
    return headers.get("X-Kvgate-Replica")


async def test_a_shared_document_goes_to_the_engine_that_holds_it_until_that_engine_restarts(
    engines, gateway_factory
):
    gw = await gateway_factory(real_config(engines, ["a", "b"]))
    events = gw.gateway.kv_events
    counter = gw.gateway.runtime.catalog.counter(MODEL_NAME)
    warm = iter(range(1000, 2000))
    async with aiohttp.ClientSession() as http:

        async def listening() -> bool:  # a SUB socket joins late: new prompts until heard
            for name in "ab":
                if events.index(name) is None:
                    await post(http, engines[name].url, chat(next(warm), "warm up"))
            return all(events.index(name) is not None for name in "ab")

        await eventually(listening, timeout_s=20, interval_s=0.2, what="both engines' events")

        async def held_by(name: str, document: int) -> bool:
            ids = (await counter.count_chat(chat(document, "x")["messages"])).token_ids
            assert ids is not None  # the model's own tokenizer and template: exact ids
            index = events.index(name)
            return index is not None and index.leading(block_keys(ids, 32)) >= 25

        # each document is read first on one engine directly (another gateway, say); then
        # every question about it goes there, whatever the system prompt's fingerprint says
        for document, holder in ((1, "a"), (2, "b")):
            await post(http, engines[holder].url, chat(document, "Summarize."))
            await eventually(lambda d=document, h=holder: held_by(h, d), timeout_s=10,
                             what=f"document {document} in {holder}'s index")  # fmt: skip
            for question in ("What is clause 7?", "Who signs?", "When does it end?"):
                assert await post(http, gw.url, chat(document, question)) == holder
        # the engine hashes blocks as kvgate computes them (vLLM's default: sha256 of the
        # pickled block, its own seed): a root block it stored agreed, and it holds every
        # block of document 1's prompt under the hash kvgate gives it
        ids = (await counter.count_chat(chat(1, "x")["messages"])).token_ids
        assert ids is not None and events.states["a"].engine is not None
        assert events.states["a"].engine.agrees is True
        index = events.index("a")
        assert index is not None
        assert all(index.holds_hash(h) for h in EngineHashes().block_hashes(ids, 32)[:25])
        resets = resets_of(gw, "b")

        # b restarts: its cache is gone, and so must kvgate's belief that it holds document 2
        await engines["b"].restart()
        await eventually(lambda: not _sync_held(events, "b"), timeout_s=30, interval_s=0.2,
                         what="b's index reset")  # fmt: skip
        assert resets_of(gw, "b") > resets
        await gw.wait_healthy(timeout_s=30)
        assert not await held_by("b", 2)
        # and it is heard again: a new document read there is found there
        await eventually(listening, timeout_s=20, interval_s=0.2, what="b's events again")
        await post(http, engines["b"].url, chat(3, "Summarize."))
        await eventually(lambda: held_by("b", 3), timeout_s=10, what="document 3 on b")
    await wait_released(gw)
    await wait_idle(engines["a"], engines["b"])


def resets_of(gw: Any, replica: str) -> float:
    """Times kvgate emptied this replica's index, for any reason."""
    return sum(s.value for m in gw.gateway.metrics.kv_events_resets.collect()
               for s in m.samples
               if s.name.endswith("_total") and s.labels.get("replica") == replica)


def _sync_held(events: Any, name: str) -> bool:
    index = events.index(name)
    return index is not None and len(index) > 0
