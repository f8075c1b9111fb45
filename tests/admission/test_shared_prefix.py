"""Shared blocks on the ledger: a block that live requests on a replica begin with is reserved
once there, whatever prompts they share it through (a system prompt, a document after it, a
chat resent with its history), and its last user's ending gives it back.

- the per-replica count against a plain recount, after any sequence of uses;
- the ledger in the store against the blocks its live requests hold, while requests with
  shared documents are admitted, released and cancelled concurrently, on Redis and on a
  memory store whose every call takes its time (so that their changes interleave);
- exact token ids shared by content, as vLLM shares them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.admission.demand import Demand, Slot
from kvgate.admission.shared_prefix import ReplicaShare, exact_shared_blocks
from kvgate.config import AdmissionConfig, QueueConfig
from kvgate.fleet.block_index import block_keys
from kvgate.state.base import StateStore
from kvgate.state.memory import MemoryStore
from tests.admission.harness import Harness, admit, replica

# a use is a prefix of one of three chains: (chain, its length)
USES = st.lists(st.tuples(st.sampled_from(["use", "end"]), st.integers(0, 2), st.integers(0, 12)),
                max_size=80)


def chain(which: int, length: int) -> list[Hashable]:
    """Three chains that share their first 4 keys (a system prompt), then differ."""
    return [("sys", i) if i < 4 else (which, i) for i in range(length)]


@given(USES)
@settings(max_examples=300, deadline=None)
def test_the_counted_blocks_are_the_distinct_keys_of_the_live_uses(steps):
    share = ReplicaShare("r")
    live: list[list[Hashable]] = []
    for op, which, length in steps:
        keys = chain(which, length)
        if op == "use":
            union = {key for use in live for key in use}
            expected_credit = next((i for i, key in enumerate(keys) if key not in union), len(keys))
            assert share.credit(keys) == expected_credit
            share.add(keys)
            live.append(keys)
        elif live:
            gone = live.pop(length % len(live))
            before = {key for use in live for key in use} | set(gone)
            after = {key for use in live for key in use}
            assert share.remove(gone) == len(before - after)
        assert share.held == len({key for use in live for key in use}) == len(share.refs)


class SlowStore(MemoryStore):
    """A memory store whose every ledger call suspends for a while, as Redis's do."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    async def try_acquire(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.rng.random() * 0.004)
        return await super().try_acquire(*args, **kwargs)

    async def release(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.rng.random() * 0.004)
        return await super().release(*args, **kwargs)


SYSTEM = list(range(1000, 1000 + 16 * 3 + 5))  # 53 tokens: 3 full blocks


def document_chat(document: int, question: int) -> tuple[int, ...]:
    """A system prompt, one of a few documents, and a question: a RAG chat's token ids."""
    body = [document * 10_000 + i for i in range(16 * (4 + document * 3))]
    return (*SYSTEM, *body, 7_000_000 + question)


@pytest.fixture(params=["slow-memory", pytest.param("redis", marks=pytest.mark.redis)])
def ledger_store(request: pytest.FixtureRequest) -> StateStore:
    if request.param == "redis":
        redis: StateStore = request.getfixturevalue("redis_store")
        return redis
    return SlowStore(random.Random(request.node.name))


@pytest.mark.parametrize("seed", range(3))
async def test_the_ledger_holds_each_live_block_once_while_requests_come_and_go_concurrently(
    seed: int, ledger_store: StateStore
):
    rng = random.Random(seed)
    h = Harness(AdmissionConfig(target_utilization=1.0,
                                queue=QueueConfig(max_depth=64, max_wait_s=5)), ledger_store)
    dispatcher = asyncio.create_task(h.admission.dispatch("p"))
    r = replica("a", blocks=400)
    ledger = h.admission.ledger
    live: set[Slot] = set()  # every slot from the moment the ledger grants it to its release
    reserve, give_back = ledger.reserve, ledger.give_back

    async def reserving(*args, **kwargs):  # type: ignore[no-untyped-def]
        slot = await reserve(*args, **kwargs)
        if slot is not None:
            live.add(slot)
        return slot

    async def giving_back(slot: Slot) -> None:
        live.discard(slot)
        await give_back(slot)

    ledger.reserve, ledger.give_back = reserving, giving_back  # type: ignore[method-assign]

    def expected() -> int:
        """Each live slot's own blocks, and every block some live slot shares, once."""
        shared = {key for slot in live if slot.shared for key in slot.shared.keys}
        return sum(slot.blocks for slot in live) + len(shared)

    async def quiet_read() -> int | None:
        """The store's figure, read while no change of ours was on its way there, checked
        against the books; None if the moment was not quiet."""
        held = await ledger.quiet_read(r.id)
        if held is None:
            return None
        assert held == expected() == h.admission.reserved.get(r.id, 0)
        return held

    async def request(n: int) -> None:
        ids = document_chat(rng.randrange(4), n)
        d = Demand("p", "m", len(ids) + 32, "t", "standard", token_ids=ids)
        async with admit(h, d, r) as slot:
            assert slot.shared is not None
            assert slot.shared.blocks == exact_shared_blocks(len(ids), 16)
            await asyncio.sleep(rng.random() * 0.02)

    tasks, checked = [], 0
    for _wave in range(12):
        for _ in range(5):
            tasks.append(asyncio.create_task(request(len(tasks))))
            await asyncio.sleep(rng.random() * 0.003)
            if rng.random() < 0.2:  # a client that hangs up: at any moment, releases included
                victim = rng.choice(tasks)
                asyncio.get_running_loop().call_later(rng.random() * 0.01, victim.cancel)
        for _ in range(50):  # a moment with no change on its way to the store: books agree
            if await quiet_read() is not None:
                checked += 1
                break
            await asyncio.sleep(0.001)
    await asyncio.gather(*tasks, return_exceptions=True)
    dispatcher.cancel()
    assert checked >= 5
    assert await h.held(r) == 0
    assert h.admission.reserved.get(r.id, 0) == 0 and len(h.admission.prefixes) == 0
    assert h.admission.keeper.live_leases() == 0


async def test_a_document_read_by_many_is_reserved_once_and_its_system_prompt_once_across_documents():
    harness = Harness(AdmissionConfig(target_utilization=1.0, queue=QueueConfig(max_wait_s=5)))
    r = replica("a", blocks=400)

    def asked(document: int, question: int) -> Demand:
        ids = document_chat(document, question)
        return Demand("p", "m", len(ids) + 16 * 4, "t", "standard", token_ids=ids)

    # 53 + 112 + 1 = 166 tokens and 64 more: 15 blocks, of which 10 shared
    async with admit(harness, asked(1, 0), r) as a:
        assert (a.shared.blocks, a.blocks) == (10, 5)
        assert await harness.held(r) == 15
        async with admit(harness, asked(1, 1), r) as b:  # the same document: its own blocks only
            assert (b.shared.blocks, b.blocks) == (10, 5)
            assert await harness.held(r) == 20
            async with admit(harness, asked(2, 0), r) as c:  # another: the system prompt is shared
                keys = block_keys(document_chat(2, 0), 16)
                assert c.shared.keys[:3] == a.shared.keys[:3] == keys[:3]
                assert (c.shared.blocks, c.blocks) == (13, 5)
                assert await harness.held(r) == 20 + (13 - 3) + 5
            assert await harness.held(r) == 20
        assert await harness.held(r) == 15  # the document stays for its last user
    assert await harness.held(r) == 0 and len(harness.admission.prefixes) == 0


def test_exact_ids_share_every_full_block_but_the_one_with_the_prompts_last_token():
    assert [exact_shared_blocks(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 0, 0, 1, 1, 2]
    ids = tuple(range(40))
    d = Demand("p", "m", 100, "t", "standard", prefix_key="m:sys", prefix_tokens=40, token_ids=ids)
    assert list(d.shared_keys(16)) == block_keys(ids, 16)[:2]  # exact ids win over the estimate
    estimated = Demand("p", "m", 100, "t", "standard", prefix_key="m:sys", prefix_tokens=40)
    assert list(estimated.shared_keys(16)) == [("m:sys", 0)]  # 2 full blocks, less one
    assert d.shared_keys(16) is d.shared_keys(16)  # made once
