"""Edges of predicted admission found in review: worst cases under any overcommit factor, open-ended
chats and the kept headroom, never_fits, targets beyond max_wait_s, large streamed bodies, a
whole answer before the decode clock runs. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from kvgate.admission.demand import Demand
from kvgate.config import AdmissionConfig, QueueConfig
from kvgate.errors import RateLimited
from kvgate.fleet.scrape import Scrape
from tests.admission.harness import Harness, admit, refused_behind_a_slow_pool, replica


async def admitted_at_once(gate: Harness, demand: Demand, r, most: int) -> tuple[int, int]:
    """Admit copies of `demand` on `r` until one has to wait (or `most`): how many got in,
    and the blocks then held."""
    admitted = 0
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(most):
            try:
                async with asyncio.timeout(0.2):
                    await stack.enter_async_context(admit(gate, demand, r))
            except TimeoutError:
                break
            admitted += 1
        return admitted, await gate.held(r)


def warmed(gate: Harness, replica_id: str) -> float:
    """Drive the replica's overcommit factor up as after_discovery does: requests wait in
    kvgate's queue while vLLM's cache has room (worst-case reservations are mostly unwritten)."""
    factor = 1.0
    for _ in range(12):
        factor = gate.admission.overcommit.observe(
            replica_id, preemptions=0, kv_usage=0.2, demand=True, waiting=0, rejections=0
        )
    return factor


async def test_worst_case_reservations_never_exceed_the_admissible_blocks_under_overcommit():
    """A worst-case reservation (worst_case class mode, or ignore_eos) holds every block it
    reserves; docs/admission.md: 'nor let past what the replica really has'. With the factor
    at 2 the rule reserved + f*blocks <= f*admissible counts the worst cases already on the
    ledger at 1/f of their size, so 200-block worst cases fill 1,600 blocks of a 1,000-block
    replica (900 admissible)."""
    gate = Harness(AdmissionConfig(target_utilization=0.9,
                                queue=QueueConfig(max_wait_s=5)))
    r = replica("a", blocks=1000)
    assert warmed(gate, r.id) == 2.0
    worst = Demand("p", "m", 16 * 200, "t", "critical")  # ahead_tokens None: the worst case
    assert not worst.predicted
    admitted, held = await admitted_at_once(gate, worst, r, 10)
    assert held <= 900, f"{admitted} worst cases admitted: {held} blocks of 1,000 held"


def _view(r, config, critical=lambda pool: True, factor=1.0):
    from kvgate.fleet.snapshot import take_snapshot

    (only,) = take_snapshot(
        [r], config=config, stale_after_s=1e13, reserved={}, shared_prefix_blocks=lambda rid: 0,
        circuit=lambda rid: "closed", overcommit=lambda rid: factor, critical=critical, now=1e12,
    )
    return only


def test_an_open_ended_predicted_chat_does_not_take_the_blocks_kept_for_the_critical_class():
    """A chat without max_tokens is bounded by the whole context (8,192 tokens = 512 blocks).
    On a 600-block replica (540 admissible, 54 kept) that worst case is above 540 - 54, so the
    exemption 'could never run without those blocks' hands the kept blocks to every such
    standard chat, though predicted mode reserves only ~29 blocks for it and it would run
    fine within the 486 (it grows unchecked anyway). A burst of open-ended chats then eats
    the critical class's headroom."""
    from tests.routing.fleets import replica as fleet_replica

    v = _view(fleet_replica("a", blocks=600),
              AdmissionConfig(target_utilization=0.9, critical_headroom=0.1))
    assert (v.admissible_blocks, v.kept_blocks) == (540, 54)
    chat = Demand("p", "m", 8192, "t", "standard", prompt_tokens=200, ahead_tokens=256)
    assert chat.predicted and chat.blocks_on(v.replica) == 29
    assert chat.limit_on(v) == 486


def test_kept_headroom_only_where_a_critical_tenant_can_go():
    """has_critical_tenant is global: a critical tenant confined to pool 'a' makes every
    replica of pool 'b' (where it can never send a request) keep 10% idle forever."""
    from kvgate.config import Config, PoolConfig, ReplicaConfig, TenantConfig
    from kvgate.fleet.replicas import Replica

    config = Config(
        pools={"a": PoolConfig(replicas=[ReplicaConfig(url="http://a:8000")]),
               "b": PoolConfig(replicas=[ReplicaConfig(url="http://b:8000")])},
        tenants=[TenantConfig(name="vip", priority="critical", pools=["a"]),
                 TenantConfig(name="bulk", priority="standard", pools=["b"])],
    )
    rb = Replica(ReplicaConfig(url="http://b:8000", name="b", num_gpu_blocks=1000,
                               block_size=16), pool="b", healthy=True, models=frozenset({"m"}))
    v = _view(rb, config.admission, critical=config.critical_pools.__contains__)
    assert v.kept_blocks == 0, f"pool b keeps {v.kept_blocks} blocks for a tenant that can't use it"


async def test_a_chat_without_max_tokens_is_not_refused_never_fits_where_vllm_serves_it():
    """No max_tokens is injected any more, so a chat that sends none is bounded by the whole
    context. A replica with 540 blocks (8,640 tokens) serves max_model_len 8,192 (vLLM
    starts when one full context fits), but 0.9 x 540 = 486 < 512 blocks: every such chat
    now gets 400 never_fits — in predicted mode too, which would reserve ~29 blocks.
    Before this change the injected 1,024 default made it fit."""
    gate = Harness(AdmissionConfig(target_utilization=0.9, queue=QueueConfig(max_wait_s=5)))
    r = replica("a", blocks=540)
    chat = Demand("p", "m", 8192, "t", "standard", prompt_tokens=200, ahead_tokens=256)
    async with asyncio.timeout(1):
        async with admit(gate, chat, r) as slot:
            assert slot.reserved_blocks == 29


async def test_a_target_above_max_wait_s_does_not_let_in_a_request_bound_to_time_out():
    """ttft_target_s may be set above max_wait_s: a request expected to wait ~4 s with
    max_wait_s 2 and a 10 s target is refused at arrival, not let in to time out."""
    refused = await refused_behind_a_slow_pool(
        QueueConfig(max_wait_s=2, ttft_target_s={"standard": 10})
    )
    assert refused.code == "wait_budget_exceeded"


async def test_worst_case_reservations_fill_the_admissible_blocks_when_the_factor_is_low():
    """The other side of the same formula: after preemptions the factor falls to 0.5, and
    then a ledger holding only worst-case reservations (exact: they hold what they reserve)
    is treated as if each held twice its blocks: three critical worst cases of 300 blocks
    fit in 900 admissible blocks, but the third waits."""
    gate = Harness(AdmissionConfig(target_utilization=0.9, queue=QueueConfig(max_wait_s=5)))
    r = replica("a", blocks=1000)
    for preemptions in range(4):  # each scrape sees a new preemption: x0.7 down to 0.5
        gate.admission.overcommit.observe(
            r.id, preemptions=float(preemptions), kv_usage=0.5, demand=True, waiting=0,
            rejections=0,
        )
    assert gate.admission.overcommit.factor(r.id) == 0.5
    worst = Demand("p", "m", 16 * 300, "t", "critical")
    admitted, _ = await admitted_at_once(gate, worst, r, 3)
    assert admitted == 3, f"{admitted} of 3 exact 300-block reservations fit in 900 blocks"


def test_a_whole_answer_sent_before_the_decode_clock_runs_is_not_written_as_its_worst_case():
    """Until a replica's decode clock has two scrapes (the first discovery interval after a
    start, a replica that just joined, or for good on a vLLM whose /metrics lacks
    generation_tokens, e.g. --disable-log-stats with num_gpu_blocks from config), a
    non-streamed request's written view is its whole worst case from the moment it is sent,
    and stays so for its life (decode_start was None). growth_target then forces its
    reservation (past any limit: UNLIMITED) to the worst case — and with no max_tokens
    injected any more, that is the whole context: 29 blocks predicted become 512."""
    import time

    from kvgate.admission.demand import Slot, growth_target
    from kvgate.admission.progress import written_tokens
    from kvgate.request.catalog import Bound
    from kvgate.request.parsed import Endpoint, ParsedRequest
    from kvgate.transport.base import Outcome

    r = replica("a", blocks=1000)
    parsed = ParsedRequest(Endpoint.CHAT, {}, "m", stream=False, client_wants_usage=False,
                           max_tokens=None, sequences=1, user=None)
    bound = Bound(prompt_tokens=200, max_tokens=8192 - 200, worst_tokens=8192,
                  set_max_tokens=False)
    outcome = Outcome()
    outcome.replica, outcome.decode_start = r, r.decode_clock.reading()  # as forward does
    outcome.sent_at = time.monotonic()
    written = written_tokens(parsed, bound, outcome)
    slot = Slot(r, "l", blocks=29, worst_blocks=512, progress=written, ahead=64)
    assert written() < 8192, "just sent, it is written as the whole context"
    assert growth_target(slot) is None or growth_target(slot) < 512


async def test_without_a_target_a_request_bound_to_outwait_max_wait_s_is_refused_at_arrival():
    """No latency target: a request waits for room up to max_wait_s, but one expected to wait
    longer is refused now with Retry-After rather than after waiting it out."""
    refused = await refused_behind_a_slow_pool(QueueConfig(max_wait_s=2))
    assert refused.code == "wait_budget_exceeded"
    assert "max_wait_s of 2s" in str(refused)


async def test_a_worst_case_slot_on_a_replica_that_left_the_fleet_is_still_given_back():
    """The replica is forgotten (it left the fleet) while a worst-case request runs there:
    its release still returns the lease, and the worst-case count does not go negative."""
    gate = Harness(AdmissionConfig(target_utilization=0.9, queue=QueueConfig(max_wait_s=5)))
    r = replica("a", blocks=1000)
    async with admit(gate, Demand("p", "m", 16 * 200, "t", "critical"), r):
        assert gate.admission.ledger.exact == {r.id: 200}
        gate.admission.ledger.forget(set())
    assert await gate.held(r) == 0
    assert gate.admission.ledger.exact == {}


def with_critical_tenant(gate: Harness) -> Harness:
    """The gate's config with a critical tenant that may use every pool: its replicas keep
    headroom for it."""
    from kvgate.config import TenantConfig

    current = gate.admission.current().model_copy(update={"tenants": [
        TenantConfig(name="vip", priority="critical"), TenantConfig(name="bulk")]})
    gate.admission.current = lambda: current
    gate.admission.keeper.current = lambda: current
    return gate


async def test_the_kept_blocks_stay_the_critical_classs_when_lower_answers_grow_past_their_limit():
    """400 blocks, 40 kept for the critical class. A bulk answer reserves its prompt and its
    predicted end (6 blocks); 60 of them fill the 360 blocks bulk may use. Their answers then
    reach their predicted end and grow a lookahead past it (8 blocks each: 480 held), which
    the ledger never refuses, into the kept blocks: a critical request arriving then queued
    behind the burst (CI saw it wait 0.056 s). The kept blocks are now counted on top of the
    lower classes' overrun: the critical request starts at once, and bulk still waits."""
    gate = with_critical_tenant(Harness(AdmissionConfig(
        target_utilization=1.0, critical_headroom=0.1, queue=QueueConfig(max_wait_s=5))))
    r = replica("a", blocks=400)
    prompt, end = 32, 32 + 64  # an answer predicted at 64 tokens; the history has no longer one
    bulk = Demand("p", "m", prompt + 16 * 60, "bulk", "standard", prompt_tokens=prompt,
                  ahead_tokens=64, margin_tokens=32, forecast=lambda written: max(written, end))
    grow = asyncio.create_task(gate.admission.ledger.grow())
    try:
        async with contextlib.AsyncExitStack() as stack:
            slots = []
            for _ in range(100):
                try:
                    async with asyncio.timeout(0.2):
                        slots.append(await stack.enter_async_context(admit(gate, bulk, r)))
                except TimeoutError:
                    break
            assert len(slots) == 60 and await gate.held(r) == 360
            for slot in slots:  # every answer reaches its predicted end and grows
                slot.progress = lambda: end
            await eventually_held(gate, r, 480)
            assert gate.admission.ledger.lower == {r.id: 480}
            async with asyncio.timeout(1):
                vip = Demand("p", "m", 16 * 40, "vip", "critical")  # all 40 kept blocks
                async with admit(gate, vip, r) as slot:
                    assert not slot.queued and await gate.held(r) == 520
                    with pytest.raises(TimeoutError):  # bulk gets none of it
                        async with asyncio.timeout(0.2):
                            await stack.enter_async_context(admit(gate, bulk, r))
        assert gate.admission.ledger.lower == {}
    finally:
        grow.cancel()
        await asyncio.gather(grow, return_exceptions=True)


async def eventually_held(gate: Harness, r, blocks: int) -> None:
    from tests.plugins.waiting import eventually

    async def grown() -> bool:
        return await gate.held(r) >= blocks

    await eventually(grown, timeout_s=2, what=f"{blocks} blocks held")


async def test_requests_refused_for_room_count_as_demand_so_overcommit_grows_into_an_idle_cache():
    """At normal load with a latency target, a request that would have to wait is refused at
    arrival and never sits in the queue. The controller must still see that it wanted room:
    with vLLM's cache at 30%, the refusals were of blocks reserved but never written, and
    the factor grows as it would for a queued request. It did not: the queue was empty at
    every scrape, so the factor stayed at 1.0 and refusals went on (mix at 1×: 150 of 501)."""
    g = Harness(AdmissionConfig(target_utilization=1.0,
                             queue=QueueConfig(max_wait_s=30, ttft_target_s={"standard": 1})))
    r = replica("a", blocks=100)
    pool = g.admission.pool("p")
    for _ in range(4):  # requests hold a block 9 s here: 90 held free 10 blocks a second
        pool.released(10, 9.0, time.monotonic())

    def scraped() -> None:
        r.scrape = Scrape(at=time.monotonic(), kv_usage=0.3, waiting=0, preemptions=0,
                          admission_rejections=0)
        g.admission.after_discovery([r])

    async with admit(g, Demand("p", "m", 16 * 90, "t", "standard"), r):
        scraped()  # no request wanted room yet: nothing grows
        assert g.admission.overcommit.factor(r.id) == 1.0
        with pytest.raises(RateLimited) as refused:
            async with admit(g, Demand("p", "m", 16 * 50, "t", "standard"), r):
                pass
        assert refused.value.code == "wait_budget_exceeded"
        assert len(pool.queue) == 0
        scraped()
        assert g.admission.overcommit.factor(r.id) > 1.0
        grown = g.admission.overcommit.factor(r.id)
        scraped()  # the refusal is counted once: no request wanted room since
        assert g.admission.overcommit.factor(r.id) == grown
