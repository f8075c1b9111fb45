"""Clients that hang up at the worst moments leave nothing held.

Many clients close the connection as soon as they read `[DONE]`; aiohttp then cancels the
handler while kvgate releases what the request held. Every release — the request's ledger
lease, the shared-prefix lease, the tenant's concurrency lease and its budget settlement —
must still run to its end.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from kvgate.state.base import StateStore
from kvgate.tenants import tenant_key
from tests.accounting.clients import hang_up_at_done
from tests.plugins.gateway import gateway_config, wait_settled

HANGUPS = 200


def system_prompt(i: int) -> str:
    # Long enough that its full blocks are reserved as a shared prefix of their own.
    return f"You are assistant number {i}. " + "Answer briefly and cite sources. " * 30


async def test_hanging_up_at_done_hundreds_of_times_leaves_every_ledger_at_zero(
    store: StateStore, stub_factory: Any, gateway_factory: Any
) -> None:
    stubs = [await stub_factory(chunks=4) for _ in range(2)]
    config = gateway_config(
        [s.url for s in stubs],
        auth={"mode": "none", "anonymous_tenant": "team"},
        tenants=[{"name": "team", "max_concurrent": 64, "tokens_per_minute": 10_000_000}],
    )
    gw = await gateway_factory(config, store=store)
    rng = random.Random(7)

    async def one(i: int) -> bool:
        body = {
            "model": "stub-model", "stream": True, "max_tokens": 8,
            "messages": [
                {"role": "system", "content": system_prompt(rng.randrange(12))},
                {"role": "user", "content": f"question {i}"},
            ],
        }
        return await hang_up_at_done(gw.url, body)

    for start in range(0, HANGUPS, 20):
        done = await asyncio.gather(*(one(i) for i in range(start, start + 20)))
        assert all(done)

    await wait_settled(gw)
    admission = gw.gateway.admission
    assert len(admission.prefixes) == 0, "a shared-prefix lease outlived every request using it"
    assert admission.keeper.live_leases() == 0
    for replica in gw.gateway.registry:
        assert admission.reserved.get(replica.id, 0) == 0
    assert await store.held(tenant_key("team", "concurrency")) == 0
