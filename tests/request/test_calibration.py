"""The affine estimate of vLLM's prompt_tokens: its prior, its online fit, its bounds."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.config import CalibrationConfig
from kvgate.request.calibration import Calibration, Features, Observed, Terms

CHATML = Terms(1.0, 5.0, 3.0)
LIMITS = CalibrationConfig()  # the ratio within [0.8, 1.5]


def test_before_any_observation_the_prior_is_the_estimate():
    calibration = Calibration()
    features = Features(100, messages=2, prompts=1)
    assert calibration.estimate("m", "chat", features, CHATML, LIMITS) == 100 + 2 * 5 + 3


def test_a_fixed_cost_per_message_is_learned_which_one_ratio_could_not_fix():
    # The real template costs 9 per message and 25 per request (a default system prompt);
    # the tokenizer counts text 5% low. Short and long messages alike.
    rng = random.Random(1)
    calibration = Calibration()
    samples = []
    for _ in range(400):
        messages = rng.randint(1, 12)
        text = sum(rng.choice((3, 8, 40, 400)) for _ in range(messages))
        features = Features(text, messages, 1)
        actual = round(1.05 * text) + 9 * messages + 25
        samples.append((features, actual))
        calibration.observe("m", "chat", features, actual, CHATML, LIMITS)
    terms = calibration.terms("m", "chat", CHATML, LIMITS)
    assert terms.ratio == pytest.approx(1.05, abs=0.01)
    assert terms.per_message == pytest.approx(9, abs=0.5)
    assert terms.per_request == pytest.approx(25, abs=2)
    errors = [(terms.estimate(f) - a) / a for f, a in samples[-100:]]
    assert sum(abs(e) for e in errors) / len(errors) < 0.02
    assert calibration.error("m", "chat") == pytest.approx(0, abs=0.02)


def test_endpoints_are_fitted_apart_so_chats_do_not_skew_completions():
    calibration = Calibration()
    for text in range(10, 400, 7):
        calibration.observe("m", "chat", Features(text, 2, 1), text + 40, CHATML, LIMITS)
        calibration.observe("m", "completions", Features(text, 0, 1), text, Terms(), LIMITS)
    assert calibration.estimate("m", "completions", Features(200, 0, 1), Terms(), LIMITS) == 200
    assert calibration.estimate("m", "chat", Features(200, 2, 1), CHATML, LIMITS) == 240


def test_terms_stay_within_bounds_whatever_the_replica_reports():
    high, low = Calibration(), Calibration()
    for text in range(100, 1000, 10):
        high.observe("m", "chat", Features(text, 1, 1), 100 * text, CHATML, LIMITS)
        low.observe("m", "chat", Features(text, 1, 1), 1, CHATML, LIMITS)
    terms = high.terms("m", "chat", CHATML, LIMITS)
    assert terms.ratio == 1.5 and terms.per_message == 64 and terms.per_request == 2048
    terms = low.terms("m", "chat", CHATML, LIMITS)
    assert terms.ratio == 0.8 and terms.per_message == 0 and terms.per_request == -8


def test_within_its_bounds_the_fit_still_matches_what_it_can():
    # Features that never vary cannot separate the terms; the estimate must still fit them.
    calibration = Calibration()
    for _ in range(300):
        calibration.observe("m", "chat", Features(100, 2, 1), 180, CHATML, LIMITS)
    assert calibration.estimate("m", "chat", Features(100, 2, 1), CHATML, LIMITS) == pytest.approx(180, abs=1)


def test_the_one_number_ratio_reads_actual_over_estimate():
    calibration = Calibration()
    assert calibration.ratio("m") == 1.0
    calibration.observe("m", "chat", Features(100, 1, 1), 216, CHATML, LIMITS)  # estimate 108
    assert calibration.ratio("m") == pytest.approx(2.0)


def test_a_burst_of_odd_answers_leaves_the_best_terms_within_bounds_not_a_corner():
    # 300 honest chats, then 60 replies far below anything the text could give (a prompt the
    # replica truncated, say): the fit must stay the best one within the bounds.
    rng = random.Random(5)
    calibration = Calibration()
    data = []
    for _ in range(300):
        f = Features(rng.randint(20, 3000), rng.randint(1, 50), 1)
        data.append((f, f.text_tokens + 5 * f.messages + 3))
    for _ in range(60):
        data.append((Features(4000, 1, 1), 16))
    for f, actual in data:
        calibration.observe("m", "chat", f, actual, CHATML, LIMITS)
    terms = calibration.terms("m", "chat", CHATML, LIMITS)

    def cost(t: Terms) -> float:
        return sum((t.estimate(f) - y) ** 2 for f, y in data[-200:])

    # no corner of the box does better than what the solver found (the fit alone, unfloored)
    corners = [Terms(r, m, p) for r in (0.8, 1.5) for m in (0.0, 64.0) for p in (-8.0, 2048.0)]
    fitted = Terms(*terms.vector())
    assert all(cost(fitted) <= cost(c) for c in corners)
    assert terms.per_message < 64


def test_bounds_a_reload_moves_hold_at_once_and_the_next_observation_refits_within_them():
    calibration = Calibration()
    for text in range(100, 1000, 10):  # the replica counts 40% more than the text
        calibration.observe("m", "chat", Features(text, 1, 1), round(1.4 * text) + 8, CHATML, LIMITS)
    assert calibration.terms("m", "chat", CHATML, LIMITS).ratio == pytest.approx(1.4, abs=0.01)
    narrower = CalibrationConfig(min_ratio=0.9, max_ratio=1.1)
    assert calibration.terms("m", "chat", CHATML, narrower).ratio == 1.1
    assert calibration.observe("m", "chat", Features(500, 1, 1), 708, CHATML, narrower)
    terms = calibration.terms("m", "chat", CHATML, narrower)
    assert terms.ratio == 1.1 and terms.per_request > 8  # the rest of the count moved elsewhere


# Seven ordinary chats whose tool schemas kvgate counts as text while the template renders them
# compactly: vLLM counts about two thirds of kvgate's tokens, with two to five messages each.
ORDINARY = [(2000, 2, 1330), (1800, 3, 1200), (2200, 4, 1460), (1500, 2, 1000), (2100, 5, 1400),
            (1900, 3, 1270), (1700, 4, 1130)]  # fmt: skip


def test_a_few_ordinary_chats_cannot_pull_a_long_chat_below_its_raw_count():
    # Fitted alone, these drive every term to its lower bound, and a chat of 300 short
    # messages comes out at 232 tokens against vLLM's 1,803.
    calibration = Calibration()
    for text, messages, actual in ORDINARY:
        calibration.observe("m", "chat", Features(text, messages, 1), actual, CHATML, LIMITS)
    hi = Features(300, messages=300, prompts=1)
    vllm_count = 300 + 300 * 5 + 3  # the template's own count: the raw count is exact here
    terms = calibration.terms("m", "chat", CHATML, LIMITS)
    assert Terms(*terms.vector()).estimate(hi) < vllm_count / 2  # the fit alone runs away
    assert terms.estimate(hi) >= vllm_count - LIMITS.max_undercount_tokens
    assert terms.floored(hi)  # and says so, for the gateway to count


def test_the_fit_lowers_an_estimate_by_one_block_at_most_and_raises_it_freely():
    low = Calibration()
    for text, messages, actual in ORDINARY:  # vLLM counts two thirds of the raw count
        low.observe("m", "chat", Features(text, messages, 1), actual, CHATML, LIMITS)
    like_those = Features(2000, 3, 1)
    raw = CHATML.estimate(like_those)
    assert low.estimate("m", "chat", like_those, CHATML, LIMITS) == raw - 16  # safe side
    high = Calibration()
    for text, messages, actual in ORDINARY:  # vLLM counts a third more than the raw count
        high.observe("m", "chat", Features(text, messages, 1), actual * 2, CHATML, LIMITS)
    terms = high.terms("m", "chat", CHATML, LIMITS)
    assert terms.estimate(like_those) > raw * 1.2
    assert not terms.floored(like_those)


@given(
    st.lists(
        st.tuples(
            st.integers(0, 4000), st.integers(0, 300), st.floats(0.2, 5.0, allow_nan=False)
        ),
        max_size=60,
    ),
    st.integers(0, 4000),
    st.integers(0, 300),
)
@settings(max_examples=200, deadline=None)
def test_after_any_sequence_of_chats_no_estimate_is_a_block_below_the_raw_count(
    history: list[tuple[int, int, float]], text: int, messages: int
) -> None:
    """Whatever the replica reported before (any chats, any counts from a fifth to five
    times the raw one), no estimate falls more than one block below the raw count: the
    tokenizer's count plus the configured template overhead. Where vLLM counts at least that
    much — its template costs at least the configured overhead and its tokenizer counts no
    fewer tokens — no estimate undercounts vLLM by more than a block."""
    calibration = Calibration()
    for t, m, factor in history:
        features = Features(t, m, 1)
        calibration.observe("m", "chat", features, max(1, round(factor * CHATML.estimate(features))),
                            CHATML, LIMITS)  # fmt: skip
    features = Features(text, messages, 1)
    estimate = calibration.estimate("m", "chat", features, CHATML, LIMITS)
    assert estimate >= CHATML.estimate(features) - LIMITS.max_undercount_tokens


def test_a_pinned_ratio_min_equal_to_max_fits_the_other_terms_without_dividing_by_zero():
    pinned = CalibrationConfig(min_ratio=1.0, max_ratio=1.0)
    calibration = Calibration()
    rng = random.Random(3)
    for _ in range(200):
        messages = rng.randint(1, 12)
        text = rng.randint(10, 800)
        actual = round(1.2 * text) + 9 * messages + 25  # pulls the ratio up: held at 1.0
        calibration.observe("m", "chat", Features(text, messages, 1), actual, CHATML, pinned)
    terms = calibration.terms("m", "chat", CHATML, pinned)
    assert terms.ratio == 1.0
    assert terms.per_message > 5.0  # the other terms still learn


def test_a_ratio_range_upside_down_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="min_ratio"):
        CalibrationConfig(min_ratio=1.5, max_ratio=1.0)


def test_one_wild_count_is_rejected_as_an_outlier_and_a_lasting_change_is_learned():
    calibration = Calibration()
    features = Features(200, 2, 1)
    for _ in range(100):
        calibration.observe("m", "chat", features, 200 + 10 + 3, CHATML, LIMITS)
    before = calibration.terms("m", "chat", CHATML, LIMITS)
    assert calibration.observe("m", "chat", features, 20_000, CHATML, LIMITS) is Observed.OUTLIER
    assert calibration.terms("m", "chat", CHATML, LIMITS) == before
    assert calibration.outliers("m", "chat") == 1
    # the replica really changed (another tokenizer behind the same name): after a run of
    # such counts, they are folded in
    results = [
        calibration.observe("m", "chat", features, 300, CHATML, LIMITS) for _ in range(40)
    ]
    assert Observed.OUTLIER not in results  # 300 is within the outlier factor of 213
    wild = [calibration.observe("m", "chat", features, 2_000, CHATML, LIMITS) for _ in range(12)]
    assert wild[0] is Observed.OUTLIER
    assert wild[-1] is not Observed.OUTLIER
