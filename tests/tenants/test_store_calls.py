"""A tenant's budget costs one Redis call to charge and one to settle (issue 14), refusals
included, and a refused charge leaves nothing held that would need a call to give back.

Counted with the Redis store's own counters (`calls`: scripts sent; `round_trips`: pipelines).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvgate.admission.leases import LeaseKeeper
from kvgate.config import TenantConfig
from kvgate.errors import OverBudget
from kvgate.metrics import Metrics
from kvgate.state.base import BucketLimit
from kvgate.state.redis import RedisStore
from kvgate.tenants import Budgets, tenant_key
from tests.admission.harness import whole

pytestmark = pytest.mark.redis

TEAM = TenantConfig(
    name="team", max_concurrent=2, requests_per_minute=5, tokens_per_minute=1000
)


class Counted:
    """The Redis calls and round trips made since the last `take()`."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._calls, self._trips = store.calls, store.round_trips

    def take(self) -> tuple[int, int]:
        calls, trips = self.store.calls - self._calls, self.store.round_trips - self._trips
        self._calls, self._trips = self.store.calls, self.store.round_trips
        return calls, trips


@pytest.fixture
async def budgets(redis_url: str, key_prefix: str) -> AsyncIterator[Budgets]:
    store = RedisStore(redis_url, key_prefix=key_prefix, timeout_s=2.0)
    config = whole()  # its lease TTL: 30 s
    yield Budgets(store, Metrics(), LeaseKeeper(store, lambda: config))
    await store.close()


async def held(budgets: Budgets) -> tuple[int, int, int]:
    """The tenant's concurrency leases, and the requests and tokens left in its buckets."""
    store = budgets.store
    requests = await store.peek(tenant_key("team", "requests"), BucketLimit(5))
    tokens = await store.peek(tenant_key("team", "tokens"), BucketLimit(1000))
    return await store.held(tenant_key("team", "concurrency")), requests.remaining, tokens.remaining


async def test_a_request_costs_one_call_to_charge_and_one_to_settle(budgets: Budgets) -> None:
    assert isinstance(budgets.store, RedisStore)
    counted = Counted(budgets.store)
    async with budgets.charge(TEAM, 300) as charge:
        assert counted.take() == (1, 1)
        assert charge.headers["x-ratelimit-remaining-tokens"] == "700"
        await budgets.settle(charge, 100, 50)
        assert counted.take() == (1, 1)
    assert counted.take() == (0, 0)  # leaving a settled charge costs nothing more
    assert (await held(budgets))[0] == 0


async def test_a_request_that_never_ran_costs_one_call_to_give_everything_back(
    budgets: Budgets,
) -> None:
    assert isinstance(budgets.store, RedisStore)
    counted = Counted(budgets.store)
    async with budgets.charge(TEAM, 300):
        assert counted.take() == (1, 1)
    assert counted.take() == (1, 1)
    assert await held(budgets) == (0, 4, 1000)  # the request counts; the tokens came back


@pytest.mark.parametrize("refuser", ["concurrency", "requests", "tokens"])
async def test_a_refusal_costs_one_call_and_holds_nothing(budgets: Budgets, refuser: str) -> None:
    """No give-back round trip: the refused charge took nothing at all."""
    assert isinstance(budgets.store, RedisStore)
    tenant = TEAM.model_copy(update={
        "max_concurrent": 1 if refuser == "concurrency" else 2,
        "requests_per_minute": 1 if refuser == "requests" else 5,
    })  # fmt: skip
    async with budgets.charge(tenant, 700 if refuser == "tokens" else 100):
        before = await held(budgets)
        counted = Counted(budgets.store)
        with pytest.raises(OverBudget) as refused:
            async with budgets.charge(tenant, 400):
                pass
        assert counted.take() == (1, 1)
        assert refused.value.type == refuser
        assert await held(budgets) == before
