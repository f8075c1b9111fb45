"""Reading the shared ledger back never undoes this instance's own changes.

This instance's view of a replica's ledger moves at once with its own reservations and
releases; what other instances hold is learned only by reading the store. A read answered
before one of this instance's changes reached the store, but returned after it, must not put
the old figure back: after the last release the view is 0, not the blocks just released.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvgate.admission.demand import Demand, ledger_key
from kvgate.admission.leases import LeaseKeeper
from kvgate.admission.stage import Admission
from kvgate.config import AdmissionConfig
from kvgate.metrics import Metrics
from kvgate.state.memory import MemoryStore
from tests.admission.harness import replica, whole
from tests.routing.fleets import in_order

CONFIG = AdmissionConfig(target_utilization=1.0)


class HeldOpen:
    """The memory store, except that the test may hold one call open: a `held` read after the
    store answered it (on its way back), or a `release` before it reaches the store."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.hold: str | None = None  # the call to hold open: "held" or "release"
        self.reached = asyncio.Event()  # the held call got as far as it may
        self.go = asyncio.Event()  # let it finish

    async def held(self, pool: str) -> int:
        value = await self.inner.held(pool)
        await self._wait_if("held")
        return value

    async def release(self, pool: str, lease_id: str) -> int:
        await self._wait_if("release")
        return await self.inner.release(pool, lease_id)

    async def _wait_if(self, call: str) -> None:
        if self.hold == call:
            self.hold = None
            self.reached.set()
            await self.go.wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def instance(store: Any) -> Admission:
    current = whole(CONFIG)
    return Admission(store, Metrics(), lambda: current, LeaseKeeper(store, lambda: current))


def request() -> Demand:
    return Demand("p", "m", 16 * 133, "t", "standard")  # 133 blocks


async def test_a_read_answered_before_a_release_and_returned_after_it_is_not_applied():
    store = HeldOpen(MemoryStore())
    admission, r = instance(store), replica("a", blocks=1000)
    async with admission.admit(request(), in_order(admission, [r]), CONFIG):
        store.hold = "held"
        read = asyncio.create_task(admission.ledger.refresh(r.id))
        await store.reached.wait()  # the store has answered 133
    assert await store.held(ledger_key(r.id)) == 0
    store.go.set()
    await read
    assert admission.reserved.get(r.id, 0) == 0


async def test_a_read_served_while_a_release_is_on_its_way_to_the_store_is_not_applied():
    store = HeldOpen(MemoryStore())
    admission, r = instance(store), replica("a", blocks=1000)
    store.hold = "release"

    async def run_and_release() -> None:
        async with admission.admit(request(), in_order(admission, [r]), CONFIG):
            pass

    request_task = asyncio.create_task(run_and_release())
    await store.reached.wait()  # released here, not yet in the store
    await admission.ledger.refresh(r.id)  # the store still holds 133
    store.go.set()
    await request_task
    assert await store.held(ledger_key(r.id)) == 0
    assert admission.reserved.get(r.id, 0) == 0


async def test_another_instances_reservation_is_learned_from_the_store_and_its_release_too():
    store = MemoryStore()
    mine, theirs, r = instance(store), instance(store), replica("a", blocks=1000)
    async with theirs.admit(request(), in_order(theirs, [r]), CONFIG):
        assert mine.reserved.get(r.id, 0) == 0
        await mine.ledger.refresh(r.id)
        assert mine.reserved[r.id] == 133
        async with mine.admit(request(), in_order(mine, [r]), CONFIG):
            assert mine.reserved[r.id] == 266
        assert mine.reserved[r.id] == 133
    await mine.ledger.refresh(r.id)
    assert mine.reserved[r.id] == 0
