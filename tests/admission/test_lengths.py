"""The answer-length model: by the request's shape, borrowing from coarser histories, floored
by what the request forces. Pure: fed values, no clock."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvgate.admission.prediction import (
    OPEN,
    LengthModel,
    Lengths,
    Prediction,
    Shape,
    answer_floor,
    bucket,
)

SETTINGS = {"min_samples": 16, "prior_tokens": 256}


def shape(tenant: str = "t", max_tokens: int | None = 1024, prompt: int = 300,
          model: str = "m", endpoint: str = "chat", **body: object) -> Shape:  # fmt: skip
    return Shape.of(tenant, model, endpoint, body, max_tokens, prompt)


def test_buckets_are_powers_of_two_and_omitted_max_tokens_is_its_own():
    assert [bucket(n) for n in (1, 64, 65, 128, 129, 8192)] == [6, 6, 7, 7, 8, 13]
    assert bucket(None) == OPEN
    assert shape(tools=[{"type": "function"}]).structured
    assert shape(response_format={"type": "json_object"}).structured
    assert not shape().structured


def test_a_cold_model_predicts_the_prior_not_the_worst_case():
    model = LengthModel()
    prediction = model.predict(shape(), 4096, **SETTINGS)
    assert prediction.source == "prior"
    assert prediction.likely(0.95) == 256
    assert model.predict(shape(), 100, **SETTINGS).likely(0.95) == 100  # capped by max_tokens


def test_the_prediction_is_a_high_quantile_of_the_same_shape():
    model = LengthModel(window=1000)
    rng = random.Random(3)
    lengths = [int(rng.lognormvariate(5.5, 0.6)) for _ in range(1000)]
    for n in lengths:
        model.observe(shape(), n)
    prediction = model.predict(shape(), 4096, **SETTINGS)
    assert prediction.source == "shape"
    assert prediction.likely(0.95) == sorted(lengths)[950]
    longer = [n for n in lengths if n > 300]
    assert prediction.expected(300) == -(-sum(longer) // len(longer))  # the survival curve


def test_a_tenants_short_chats_do_not_predict_its_long_summaries_short():
    """The summaries' shape (another max_tokens bucket, longer prompts) has no history of its
    own: it borrows from the same shape of other tenants, not from this tenant's chats."""
    model = LengthModel()
    for _ in range(50):
        model.observe(shape("t", 1024, 300), 40)  # this tenant's chats
        model.observe(shape("other", 8192, 6000), 3000)  # summaries, by another tenant
    summary = model.predict(shape("t", 8192, 6000), 8192, **SETTINGS)
    assert summary.source == "shape_any_tenant"
    assert summary.likely(0.95) == 3000
    assert model.predict(shape("t", 1024, 300), 1024, **SETTINGS).likely(0.95) == 40


def test_a_new_prompt_length_borrows_the_tenants_answers_at_that_budget_then_coarser():
    model = LengthModel()
    for _ in range(20):
        model.observe(shape("t", 1024, 300), 500)
    assert model.predict(shape("t", 1024, 3000), 1024, **SETTINGS).source == "tenant_budget"
    assert model.predict(shape("u", 1024, 3000), 1024, **SETTINGS).source == "budget"
    assert model.predict(shape("u", 4096, 3000), 4096, **SETTINGS).source == "model"
    other = shape("u", 4096, 3000, model="other-model")
    fleet = model.predict(other, 4096, **SETTINGS)
    assert (fleet.source, fleet.likely(0.95)) == ("fleet", 500)


def test_old_answers_leave_the_window():
    model = LengthModel(window=16)
    for _ in range(16):
        model.observe(shape(), 500)
    for _ in range(16):
        model.observe(shape(), 20)
    assert model.predict(shape(), 4096, **SETTINGS).likely(0.95) == 20


def test_what_the_request_forces_beats_any_history():
    model = LengthModel()
    for _ in range(50):
        model.observe(shape(), 30)
    assert answer_floor({"ignore_eos": True}, 8192) == 8192
    assert answer_floor({"min_tokens": 500}, 8192) == 500
    assert answer_floor({"min_tokens": 500, "ignore_eos": False}, 100) == 100
    assert answer_floor({}, 8192) == 0
    forced = model.predict(shape(), 8192, **SETTINGS, floor=8192)
    assert forced.likely(0.95) == 8192 and forced.expected() == 8192
    assert model.predict(shape(), 8192, **SETTINGS, floor=500).expected(100) == 500


@given(
    st.lists(st.integers(0, 5000), min_size=0, max_size=60),
    st.integers(0, 6000), st.integers(1, 8192), st.integers(0, 8192),
)
def test_an_expected_length_is_never_below_what_is_written_or_forced_nor_above_max_tokens(
    history, written, max_tokens, floor
):
    model = LengthModel()
    for n in history:
        model.observe(shape(), n)
    floor = min(floor, max_tokens)
    prediction = model.predict(shape(), max_tokens, **SETTINGS, floor=floor)
    expected = prediction.expected(min(written, max_tokens))
    assert min(written, max_tokens) <= expected <= max_tokens
    assert floor <= expected
    assert floor <= prediction.likely(0.95) <= max_tokens


def _known(*lengths: int, floor: int = 0, max_tokens: int = 1000) -> Prediction:
    history = Lengths(window=64)
    for n in lengths:
        history.add(n)
    return Prediction(history, "fleet", floor, max_tokens, prior=256)


def test_the_survival_curve_is_the_share_of_known_answers_that_went_further() -> None:
    known = _known(10, 20, 30, 40)
    assert known.surviving(0, 15) == 3 / 4
    assert known.surviving(15, 10) == 2 / 3  # of the three past 15, two passed 25
    assert known.surviving(45, 1) == 0.0  # past every known answer: expected to end now
    assert known.surviving(5, 0) == 1.0


def test_the_survival_curve_keeps_to_the_requests_floor_and_allowance() -> None:
    assert _known(10, 20, floor=50).surviving(0, 30) == 1.0  # min_tokens / ignore_eos
    assert _known(10, 20, 900, max_tokens=35).surviving(0, 35) == 0.0
    prior = Prediction(None, "prior", 0, 1000, prior=20)
    assert (prior.surviving(0, 10), prior.surviving(0, 20)) == (1.0, 0.0)
