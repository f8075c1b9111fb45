"""What a replica's ledger may hold with one more request on it: the overcommit factor, a
reservation of the worst case under it, and the blocks kept for the critical class."""

from __future__ import annotations

from kvgate.admission.demand import Demand
from kvgate.config import AdmissionConfig
from kvgate.fleet.snapshot import take_snapshot
from tests.routing.fleets import replica


def view(factor: float = 1.0, critical: bool = True, headroom: float = 0.1):
    (only,) = take_snapshot(
        [replica("a", blocks=1000)],
        config=AdmissionConfig(target_utilization=0.9, critical_headroom=headroom),
        stale_after_s=1e13, reserved={}, shared_prefix_blocks=lambda rid: 0,
        circuit=lambda rid: "closed", overcommit=lambda rid: factor, critical=lambda pool: critical,
        now=1e12,
    )
    return only


def demand(reserve: int | None, worst: int, priority: str = "standard") -> Demand:
    return Demand("p", "m", worst, "t", priority, ahead_tokens=reserve)


def test_the_critical_class_alone_may_use_the_kept_blocks():
    v = view()
    assert (v.admissible_blocks, v.kept_blocks) == (900, 90)
    assert demand(16 * 10, 16 * 100, "critical").limit_on(v) == 900
    assert demand(16 * 10, 16 * 100, "standard").limit_on(v) == 810
    assert demand(16 * 10, 16 * 100, "sheddable").limit_on(v) == 810
    assert view(critical=False).kept_blocks == 0  # no tenant is critical: nothing is kept


def test_a_request_that_could_never_run_without_the_kept_blocks_may_use_them():
    assert demand(None, 16 * 850).limit_on(view()) == 900


def test_a_worst_case_reservation_counts_factor_times_its_blocks():
    """reserved + f × blocks ≤ f × admissible: with f = 1.5 and 544 blocks, the limit is
    1.5 × 900 − 0.5 × 544 = 1078 (critical: nothing kept)."""
    exact = demand(None, 16 * 544, "critical")
    assert exact.limit_on(view(factor=1.5)) == 1350 - 272
    assert exact.limit_on(view(factor=0.5)) == 450 + 272
    assert demand(16 * 10, 16 * 544, "critical").limit_on(view(factor=1.5)) == 1350
    assert exact.limit_on(view(factor=1.0)) == 900


def test_the_ledger_never_holds_more_than_the_replica_has_whatever_the_factor():
    """What the replica really holds is predicted / factor + exact: worst cases already on the
    ledger count whole, so neither a high factor lets them past the admissible blocks nor a
    low one keeps them from filling it."""
    exact = demand(None, 16 * 200, "critical")
    high = view(factor=2.0)._replace(reserved_blocks=800, exact_blocks=800)
    assert exact.limit_on(high) < 800 + 200  # four fit in 900; the fifth waits
    fits = view(factor=2.0)._replace(reserved_blocks=700, exact_blocks=700)
    assert exact.limit_on(fits) >= 700 + 200
    low = view(factor=0.5)._replace(reserved_blocks=600, exact_blocks=600)
    assert demand(None, 16 * 300, "critical").limit_on(low) >= 600 + 300  # the third fits
    mixed = view(factor=2.0)._replace(reserved_blocks=600, exact_blocks=200)
    # 400 predicted hold about 200: 200 exact + 200 + the 200 asked for fit in 900
    assert exact.limit_on(mixed) == int((900 - 200 - 200) * 2.0) + 200 + 200
    assert mixed.headroom_blocks("worst_case") == 900 - 200 - 200
    assert mixed.headroom_blocks("predicted") == int((900 - 200) * 2.0) + 200 - 600


def test_a_predicted_reservation_keeps_off_the_kept_blocks_whatever_its_worst_case():
    """A chat with no max_tokens is bounded by the whole context, but reserves its predicted
    length: it fits beside the kept blocks, so it may not use them."""
    chat = Demand("p", "m", 16 * 880, "t", "standard", prompt_tokens=200, ahead_tokens=256)
    assert chat.predicted and chat.limit_on(view()) == 810


def test_headroom_is_kept_only_in_pools_a_critical_tenant_may_use():
    from kvgate.config import Config, PoolConfig, ReplicaConfig, TenantConfig

    config = Config(
        pools={"a": PoolConfig(replicas=[ReplicaConfig(url="http://a:8000")]),
               "b": PoolConfig(replicas=[ReplicaConfig(url="http://b:8000")])},
        tenants=[TenantConfig(name="vip", priority="critical", pools=["a"]),
                 TenantConfig(name="bulk", priority="standard")],
    )
    assert config.critical_pools == {"a"}
    assert Config(pools=config.pools, tenants=[TenantConfig(name="vip", priority="critical")]
                  ).critical_pools == {"a", "b"}  # fmt: skip
    assert Config(pools=config.pools).critical_pools == frozenset()
