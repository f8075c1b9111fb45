"""The composite steps (`charge`, `settle`) of the StateStore contract, on every store.

A charge is all or nothing: whichever of the lease and the buckets refuses, nothing at all is
held afterwards. The same scripted sequence run on both stores gets the same answers.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass

import pytest

from kvgate.state.base import (
    BucketCorrection,
    BucketLimit,
    BucketState,
    BucketTake,
    Charged,
    LeaseHold,
    Settled,
    StateStore,
)
from kvgate.state.memory import MemoryStore
from kvgate.state.redis import RedisStore
from tests.plugins.clock import StoreTime

# Refill is negligible over a test: 100 units per 100,000 s.
SLOW = BucketLimit(capacity=100, period_s=100_000.0)
POOL, REQUESTS, TOKENS = "tenant:t/concurrency", "tenant:t/requests", "tenant:t/tokens"


def lease(lease_id: str, limit: int = 2, amount: int = 1) -> LeaseHold:
    return LeaseHold(POOL, lease_id, amount, limit, ttl_s=30)


def takes(requests: int = 1, tokens: int = 10) -> list[BucketTake]:
    return [BucketTake(REQUESTS, requests, SLOW), BucketTake(TOKENS, tokens, SLOW)]


async def levels(store: StateStore) -> tuple[int, int, int]:
    """What is held: the pool's units, and the two buckets' remaining units."""
    requests = await store.peek(REQUESTS, SLOW)
    tokens = await store.peek(TOKENS, SLOW)
    return await store.held(POOL), requests.remaining, tokens.remaining


async def test_a_charge_that_fits_takes_the_lease_and_every_amount(store: StateStore) -> None:
    charged = await store.charge(lease("a"), takes(requests=1, tokens=30))
    assert charged.granted and charged.lease_fits
    assert [(s.allowed, s.remaining) for s in charged.buckets] == [(True, 99), (True, 70)]
    assert charged.buckets[1].reset_s == pytest.approx(30_000, abs=5)
    assert await levels(store) == (1, 99, 70)


@pytest.mark.parametrize("refuser", ["concurrency", "requests", "tokens"])
async def test_a_refusal_by_any_one_leaves_nothing_held(store: StateStore, refuser: str) -> None:
    """The lease and both buckets are exactly as before the refused charge."""
    assert (await store.charge(lease("first", limit=5), takes(requests=40, tokens=40))).granted
    before = await levels(store)
    assert before == (1, 60, 60)
    refused = await store.charge(
        lease("second", limit=1 if refuser == "concurrency" else 5),
        takes(requests=61 if refuser == "requests" else 1, tokens=61 if refuser == "tokens" else 1),
    )
    assert not refused.granted
    assert refused.lease_fits == (refuser != "concurrency")
    assert [s.allowed for s in refused.buckets] == [refuser != "requests", refuser != "tokens"]
    assert [s.remaining for s in refused.buckets] == [60, 60]  # as they stand: nothing taken
    assert await levels(store) == before
    assert await store.release(POOL, "second") == 0


async def test_a_refusal_says_when_the_amount_would_fit(store: StateStore) -> None:
    await store.charge(None, takes(requests=1, tokens=90))
    refused = await store.charge(None, takes(requests=1, tokens=30))
    requests, tokens = refused.buckets
    assert requests.allowed and requests.retry_after_s == 0
    # 20 units missing at 0.001 units/s
    assert not tokens.allowed and tokens.retry_after_s == pytest.approx(20_000, abs=5)
    over = await store.charge(None, [BucketTake(TOKENS, 500, SLOW)])
    assert over.buckets[0].retry_after_s == pytest.approx(over.buckets[0].reset_s)


async def test_every_refusal_is_reported_not_only_the_first(store: StateStore) -> None:
    await store.charge(lease("a", limit=1), takes(requests=100, tokens=100))
    refused = await store.charge(lease("b", limit=1), takes(requests=1, tokens=1))
    assert not refused.lease_fits
    assert [s.allowed for s in refused.buckets] == [False, False]


async def test_a_charge_without_a_lease_or_buckets(store: StateStore) -> None:
    assert (await store.charge(None, takes(tokens=5))).granted
    only_lease = await store.charge(lease("a", limit=1), [])
    assert only_lease.granted and only_lease.buckets == ()
    assert not (await store.charge(lease("b", limit=1), [])).granted
    assert await levels(store) == (1, 99, 95)


async def test_a_charge_counts_the_leases_taken_by_single_calls(store: StateStore) -> None:
    """Single calls and composite steps on one name address the same state."""
    assert await store.try_acquire(POOL, "single", 1, limit=2, ttl_s=30)
    await store.take(TOKENS, 50, SLOW)
    assert (await store.charge(lease("a"), takes(tokens=50))).granted
    assert not (await store.charge(lease("b"), takes(tokens=1))).granted
    assert await store.renew(POOL, ["a", "single"], ttl_s=30) == 2
    assert await levels(store) == (2, 99, 0)


async def test_an_expired_lease_makes_room_for_a_charge(
    store: StateStore, store_time: StoreTime
) -> None:
    await store.charge(LeaseHold(POOL, "crashed", 1, 1, ttl_s=0.1), [])
    await store_time.advance(0.2)
    assert (await store.charge(lease("new", limit=1), takes())).granted
    assert await store.held(POOL) == 1


async def test_settle_releases_the_lease_and_corrects_the_buckets(store: StateStore) -> None:
    hold = lease("a")
    await store.charge(hold, takes(requests=1, tokens=60))
    settled = await store.settle(hold, [BucketCorrection(TOKENS, 45, SLOW)])
    assert settled.released == 1
    assert [s.remaining for s in settled.buckets] == [85]
    assert await levels(store) == (0, 99, 85)
    # released once: a second settle frees nothing; an overdraw goes into debt
    again = await store.settle(hold, [BucketCorrection(TOKENS, -120, SLOW)])
    assert again == Settled(0, again.buckets)
    assert again.buckets[0].remaining == -35
    assert again.buckets[0].reset_s == pytest.approx(135_000, abs=5)


async def test_settle_refunds_no_more_than_the_capacity(store: StateStore) -> None:
    await store.charge(None, takes(requests=1, tokens=10))
    settled = await store.settle(
        None, [BucketCorrection(TOKENS, 1_000, SLOW), BucketCorrection(REQUESTS, 1, SLOW)]
    )
    assert [(s.remaining, s.reset_s) for s in settled.buckets] == [(100, 0), (100, 0)]
    assert await store.settle(None, []) == Settled(0, ())


async def test_a_bucket_twice_in_one_step_is_a_caller_error(store: StateStore) -> None:
    with pytest.raises(ValueError, match="twice"):
        await store.charge(None, [BucketTake(TOKENS, 1, SLOW), BucketTake(TOKENS, 1, SLOW)])
    with pytest.raises(ValueError, match="capacity"):
        await store.settle(None, [BucketCorrection(TOKENS, 1, BucketLimit(capacity=0))])
    assert await levels(store) == (0, 100, 100)


async def test_concurrent_charges_hold_exactly_what_fits(store: StateStore) -> None:
    """200 charges race for 50 slots, 150 requests and 120 tokens: exactly the 50 that fit
    are held, and the 150 refused ones took nothing from the buckets."""
    results = await asyncio.gather(*(
        store.charge(LeaseHold(POOL, f"lease-{i}", 1, 50, 30), [
            BucketTake(REQUESTS, 1, BucketLimit(150, 100_000.0)),
            BucketTake(TOKENS, 2, BucketLimit(120, 100_000.0)),
        ])
        for i in range(200)
    ))  # fmt: skip
    assert sum(r.granted for r in results) == 50
    assert await store.held(POOL) == 50
    assert (await store.peek(REQUESTS, BucketLimit(150, 100_000.0))).remaining == 100
    assert (await store.peek(TOKENS, BucketLimit(120, 100_000.0))).remaining == 20


# --- both stores, one script ------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What a step answered, without the times (the stores' clocks differ by microseconds)."""

    lease_fits: bool | int
    buckets: tuple[tuple[bool, int], ...]

    @staticmethod
    def of(result: Charged | Settled) -> Answer:
        states: tuple[BucketState, ...] = result.buckets
        head = result.lease_fits if isinstance(result, Charged) else result.released
        return Answer(head, tuple((s.allowed, s.remaining) for s in states))


async def run_script(store: StateStore, seed: int) -> list[object]:
    """A seeded mix of charges (some refused by each limit), settlements and single calls on
    three tenants; every answer, and every tenant's holdings after each step."""
    rng = random.Random(seed)
    held: dict[str, list[LeaseHold]] = {t: [] for t in "abc"}
    trace: list[object] = []
    for step in range(300):
        tenant = rng.choice("abc")
        pool, requests, tokens = (f"tenant:{tenant}/{k}" for k in ("concurrency", "requests", "tokens"))
        limits = BucketLimit(12, 100_000.0), BucketLimit(600, 100_000.0)
        roll = rng.random()
        if roll < 0.55:
            hold = LeaseHold(pool, f"{tenant}-{step}", 1, 4, 30)
            charged = await store.charge(hold, [
                BucketTake(requests, 1, limits[0]), BucketTake(tokens, rng.randint(1, 100), limits[1]),
            ])  # fmt: skip
            if charged.granted:
                held[tenant].append(hold)
            trace.append(("charge", Answer.of(charged)))
        elif roll < 0.9 and held[tenant]:
            hold = held[tenant].pop(rng.randrange(len(held[tenant])))
            delta = rng.randint(-60, 120)
            settled = await store.settle(hold, [BucketCorrection(tokens, delta, limits[1])])
            trace.append(("settle", Answer.of(settled)))
        else:
            trace.append(("put_back", (await store.put_back(requests, 1, limits[0])).remaining))
        trace.append((
            await store.held(pool),
            (await store.peek(requests, limits[0])).remaining,
            (await store.peek(tokens, limits[1])).remaining,
        ))  # fmt: skip
    return trace


def refused_by(answer: Answer) -> str:
    if not answer.lease_fits:
        return "concurrency"
    requests, tokens = answer.buckets
    return "requests" if not requests[0] else "tokens" if not tokens[0] else "granted"


@pytest.mark.redis
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_memory_and_redis_answer_a_script_of_charges_alike(
    memory_store: MemoryStore, redis_store: RedisStore, seed: int
) -> None:
    memory, redis = await run_script(memory_store, seed), await run_script(redis_store, seed)
    outcomes = Counter(
        refused_by(entry[1]) for entry in memory
        if isinstance(entry, tuple) and entry[0] == "charge" and isinstance(entry[1], Answer)
    )  # fmt: skip
    # the script reaches every limit, several times
    assert min(outcomes[k] for k in ("granted", "concurrency", "requests", "tokens")) >= 10
    assert redis == memory
