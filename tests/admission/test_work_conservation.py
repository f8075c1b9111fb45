"""Work conservation: a predicted request the ledger has no room for starts at once where the
replica's own vLLM figures say it could run it now (`kvgate.admission.room`), and waits in
kvgate's queue where they do not: vLLM queues, preempted lately, is full once what kvgate's
running requests will soon write is counted, or the room is the critical class's."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvgate.admission.demand import Demand, Slot
from kvgate.admission.room import Curve, Holding, holdings, occupancy, steps
from kvgate.config import AdmissionConfig, QueueConfig
from kvgate.errors import RateLimited
from kvgate.fleet.replicas import Replica
from kvgate.fleet.scrape import Scrape
from tests.admission.harness import Harness, admit, replica


def predicted(reserve: int, worst: int = 16 * 200, priority: str = "standard") -> Demand:
    """A predicted request of a 16-token prompt that reserves `reserve` tokens in all."""
    return Demand("p", "m", worst, "t", priority, ahead_tokens=reserve - 16, prompt_tokens=16)


def scraped(r: Replica, usage: float, waiting: float = 0, running: float = 0,
            preemptions: float = 0) -> None:  # fmt: skip
    r.scrape = Scrape(at=time.monotonic(), num_gpu_blocks=r.num_gpu_blocks, block_size=16,
                      kv_usage=usage, running=running, waiting=waiting,
                      preemptions=preemptions)  # fmt: skip


def harness(headroom: float = 0.0) -> Harness:
    """A ledger that admits up to 50% of 100 blocks, and refuses at once what does not fit
    (max_wait_s: a short wait, then 429)."""
    return Harness(AdmissionConfig(
        target_utilization=0.5, critical_headroom=headroom,
        queue=QueueConfig(max_wait_s=0.05),
    ))  # fmt: skip


async def fill_ledger(h: Harness, r: Replica) -> Any:
    """Half of the replica's 100 blocks reserved: the ledger's limit."""
    return admit(h, predicted(16 * 50), r)


async def waits_past_full_ledger(h: Harness, r: Replica, demand: Demand) -> None:
    """With the ledger at its limit, `demand` is not admitted: it waits, then times out."""
    async with await fill_ledger(h, r):
        with pytest.raises(RateLimited):
            async with admit(h, demand, r):
                pass


def expected_peak(running: list[Holding], newcomer: Holding, block_size: int) -> float:
    return Curve(running, block_size).peak_with(newcomer, block_size)


def metric(h: Harness, name: str, *labels: str) -> float:
    child = getattr(h.admission.metrics, name).labels(*labels)
    return next(s.value for m in child.collect() for s in m.samples
                if s.name.endswith("_total"))  # fmt: skip


async def test_the_ledger_full_but_vllm_with_room_starts_the_request_at_once() -> None:
    h, r = harness(), replica("a", blocks=100)
    scraped(r, usage=0.2)  # vLLM holds 20 of 100: the ledger's 50 are mostly expectation
    h.admission.after_discovery([r])
    async with await fill_ledger(h, r):
        async with admit(h, predicted(16 * 10), r) as slot:
            assert slot.replica is r and not slot.queued
            assert await h.held(r) == 60  # past the ledger's limit, on vLLM's word
        assert metric(h, "work_conserving", "p", r.id) == 1


@pytest.mark.parametrize("why", ["vllm_queues", "preempted", "full", "stale"])
async def test_without_vllms_word_for_room_the_ledger_decides(why: str) -> None:
    h, r = harness(), replica("a", blocks=100)
    scraped(r, usage=0.2)
    h.admission.after_discovery([r])
    async with await fill_ledger(h, r):
        if why == "vllm_queues":
            scraped(r, usage=0.2, waiting=1)
        elif why == "preempted":
            scraped(r, usage=0.2, preemptions=3)  # it rose since the last scrape
        elif why == "full":
            scraped(r, usage=0.95)
        h.admission.after_discovery([r])
        if why == "stale":
            r.scrape = Scrape(at=time.monotonic() - 3600, num_gpu_blocks=100, block_size=16,
                              kv_usage=0.0, running=0, waiting=0)  # fmt: skip
        with pytest.raises(RateLimited):
            async with admit(h, predicted(16 * 10), r):
                pass
    assert await h.held(r) == 0


async def test_worst_case_requests_never_use_vllms_word() -> None:
    h, r = harness(), replica("a", blocks=100)
    scraped(r, usage=0.0)
    h.admission.after_discovery([r])
    await waits_past_full_ledger(h, r, Demand("p", "m", 16 * 10, "t", "standard"))


async def test_the_critical_classs_kept_blocks_are_not_offered_to_lower_classes() -> None:
    """vLLM has 30 blocks free; 10% of the 50 admissible (5 blocks) are the critical class's
    and a standard request of 28 does not fit the rest (30 - 1 watermark - 5 = 24)."""
    h, r = harness(headroom=0.1), replica("a", blocks=100)
    scraped(r, usage=0.7)
    h.admission.after_discovery([r])
    await waits_past_full_ledger(h, r, predicted(16 * 28))


def ends_at(blocks: int, reserved: int) -> Holding:
    """A request holding `blocks` that ends once it holds `reserved` (no survival curve)."""
    return Holding(blocks, blocks * 16, reserved, None)


def test_a_burst_peaks_at_the_sum_of_what_its_requests_will_hold() -> None:
    """Young requests all near their ends together: the peak is their reservations' sum."""
    assert expected_peak([ends_at(1, 10)] * 4, ends_at(1, 10), 16) == 50


def test_requests_at_staggered_stages_peak_below_their_reservations_sum() -> None:
    """Ten requests of 10 blocks each, at every stage from just begun to about to end: as one
    ends the others grow; the most held at once is what they hold now (55), not 100."""
    staggered = [ends_at(w, 10) for w in range(1, 10)]
    assert expected_peak(staggered, ends_at(10, 10), 16) == 55


def test_a_survival_curve_weighs_each_step_by_the_chance_the_answer_is_still_running() -> None:
    """Half of such answers end within each 16 tokens: held 1 + n blocks after n steps with
    chance 1/2^n (expected 1, 1, 0.75, 0.5), its spread that of a coin of those odds."""

    def halves(written: int, more: int) -> float:
        return 0.5 ** (more // 16)

    curve = Holding(1, 16, 10, halves)
    assert [mean for mean, _ in occupancy(curve, [0, 1, 2, 3], 16)] == [1.0, 1.0, 0.75, 0.5]
    assert [var for _, var in occupancy(curve, [0, 1], 16)] == [0.0, 4 * 0.25]
    # ten such: 10 expected, at most 10 now and no spread; a step on, 10 expected ± 2 × √10
    assert expected_peak([curve] * 9, curve, 16) == pytest.approx(10 + 2 * 10**0.5)


def test_many_short_answers_need_less_room_for_their_spread_than_few_long_ones() -> None:
    def coin(written: int, more: int) -> float:
        return 0.5 if more else 1.0

    many = expected_peak([Holding(1, 16, 2, coin)] * 99, Holding(1, 16, 2, coin), 16)
    few = expected_peak([Holding(10, 160, 20, coin)] * 9, Holding(10, 160, 20, coin), 16)
    # both hold 100 blocks now and expect as much a step on; the few spread further
    assert many < few


def test_the_steps_read_every_block_first_then_two_per_doubling() -> None:
    assert steps(3) == [0, 1, 2, 3]
    assert steps(40) == [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40]


def test_holdings_count_what_is_written_and_what_is_reserved() -> None:
    r = replica("a", blocks=100)
    slots = [Slot(r, "sent", 10, progress=lambda: 40), Slot(r, "placed", 6),
             Slot(r, "gone", 8, progress=lambda: 16, released=True)]  # fmt: skip
    assert holdings(slots, 16) == [Holding(3, 40, 10, None), Holding(0, 0, 6, None)]


async def test_a_burst_is_not_let_in_past_what_vllm_can_hold() -> None:
    """Requests of 10 blocks each (a 1-block prompt) on a replica vLLM reports empty, while
    the ledger is full at its 50% with one request that has written 1 block of its 50: vLLM's
    word lets in only as many as the cache (99 blocks after the watermark) holds when they
    near their ends together, 9 steps from now, while the first has written 10 of its 50."""
    h, r = harness(), replica("a", blocks=100)
    scraped(r, usage=0.0)
    h.admission.after_discovery([r])
    admitted = []
    async with await fill_ledger(h, r) as first:
        first.progress = lambda: 16
        for _ in range(20):
            cm = admit(h, predicted(16 * 10), r)
            try:
                slot = await cm.__aenter__()
            except RateLimited:
                break
            slot.progress = lambda: 16  # sent: its prompt written
            admitted.append(cm)
        n = len(admitted)
        for cm in reversed(admitted):
            await cm.__aexit__(None, None, None)
    assert n == 8  # 8 × 10 + 10 = 90 <= 99; a ninth: 100 + 11 > 99
    assert await h.held(r) == 0


async def test_a_request_with_a_latency_target_is_placed_by_the_ledger_alone() -> None:
    """Its wait estimate, and the refusals at arrival it decides, are read from the ledger:
    letting it past the ledger under overload cost the production trace at 3× a fifth of its
    goodput. vLLM has room here, and it still waits (then times out)."""
    h = Harness(AdmissionConfig(
        target_utilization=0.5, critical_headroom=0.0,
        queue=QueueConfig(max_wait_s=0.05, ttft_target_s={"standard": 10.0}),
    ))  # fmt: skip
    r = replica("a", blocks=100)
    scraped(r, usage=0.2)
    h.admission.after_discovery([r])
    await waits_past_full_ledger(h, r, predicted(16 * 10))

