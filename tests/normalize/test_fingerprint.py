"""Prefix fingerprints, and the tracker that turns them into drift signals."""

from __future__ import annotations

import logging

import pytest

from kvgate.normalize.config import FingerprintConfig
from kvgate.normalize.fingerprint import Tracker, fingerprint
from tests.normalize.helpers import chat, completion, run, system, user

CONFIG = FingerprintConfig(window_s=100, log_interval_s=0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_equal_prefixes_share_a_fingerprint_whatever_follows():
    a = fingerprint(chat(system("You help."), user("first question")))
    b = fingerprint(chat(system("You help."), user("another"), {"role": "assistant", "content": "x"}))
    assert a == b and a is not None and len(a) == 16


@pytest.mark.parametrize("other", [
    chat(system("You help!"), user("q")),  # the system prompt differs
    chat(system("You help."), user("q"), tools=[{"type": "function", "function": {"name": "f"}}]),
    chat(system("You help."), system("Be brief."), user("q")),  # a second leading system message
])
def test_a_different_system_prompt_or_tools_block_changes_the_fingerprint(other):
    assert fingerprint(other) != fingerprint(chat(system("You help."), user("q")))


def test_the_model_is_part_of_the_fingerprint():
    parsed = chat(system("s"), user("q"))
    from dataclasses import replace

    assert fingerprint(parsed) != fingerprint(replace(parsed, model="other"))


def test_noise_normalization_removes_gives_the_same_fingerprint():
    noisy = run(chat(system("You help.  \r\nBe brief.\u200b"), user("q"))).request
    assert fingerprint(noisy) == fingerprint(chat(system("You help.\nBe brief."), user("q")))


@pytest.mark.parametrize("parsed", [chat(user("no system prompt")), completion("text")])
def test_no_system_prompt_and_no_tools_means_no_fingerprint(parsed):
    assert fingerprint(parsed) is None


def test_a_new_fingerprint_after_a_known_one_is_a_change_and_is_logged_once(caplog):
    tracker = Tracker(Clock())
    assert tracker.observe("acme", "m", "old", CONFIG) is None  # the first is no change
    assert tracker.observe("acme", "m", "old", CONFIG) is None
    with caplog.at_level(logging.WARNING, logger="kvgate.normalize.fingerprint"):
        assert tracker.observe("acme", "m", "new", CONFIG) == "old"
        assert tracker.observe("acme", "m", "new", CONFIG) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["system prompt changed: tenant acme, model m, fingerprint old -> new"]


def test_alternating_between_two_live_prompts_is_not_drift():
    tracker = Tracker(Clock())
    changes = [tracker.observe("acme", "m", key, CONFIG) for key in ["a", "b", "a", "b", "a"]]
    assert changes == [None, "a", None, None, None]


def test_tenants_and_models_drift_apart():
    tracker = Tracker(Clock())
    tracker.observe("acme", "m", "a", CONFIG)
    assert tracker.observe("other", "m", "b", CONFIG) is None
    assert tracker.observe("acme", "m2", "b", CONFIG) is None


def test_change_lines_are_rate_limited_per_tenant_and_model(caplog):
    clock = Clock()
    tracker = Tracker(clock)
    config = FingerprintConfig(window_s=1000, log_interval_s=60)
    with caplog.at_level(logging.WARNING, logger="kvgate.normalize.fingerprint"):
        for key in ["a", "b", "c", "d"]:
            tracker.observe("acme", "m", key, config)
        clock.now += 61
        tracker.observe("acme", "m", "e", config)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[1].endswith("d -> e (2 more changes since the last line)")


def test_requests_are_counted_per_fingerprint_and_forgotten_after_the_window():
    clock = Clock()
    tracker = Tracker(clock)
    for _ in range(3):
        tracker.observe("acme", "m", "a", CONFIG)
    tracker.observe("beta", "m", "a", CONFIG)
    tracker.observe("beta", "m", "b", CONFIG)
    assert tracker.top(CONFIG) == ([("a", 4), ("b", 1)], 0)
    assert tracker.per_tenant(CONFIG) == {"acme": 1, "beta": 2}
    clock.now += 60  # past half a window: counted as the previous half
    assert tracker.top(CONFIG) == ([("a", 4), ("b", 1)], 0)
    clock.now += 101
    assert tracker.top(CONFIG) == ([], 0)
    assert tracker.observe("acme", "m", "a", CONFIG) is None  # forgotten, but still the latest


def test_only_the_top_n_fingerprints_are_named_and_the_rest_is_other():
    tracker = Tracker(Clock())
    config = FingerprintConfig(top_n=2)
    for key, n in [("a", 5), ("b", 3), ("c", 2), ("d", 1)]:
        for _ in range(n):
            tracker.observe("t", "m", key, config)
    assert tracker.top(config) == ([("a", 5), ("b", 3)], 3)


def test_tracked_fingerprints_are_bounded_least_recently_seen_first():
    tracker = Tracker(Clock())
    config = FingerprintConfig(max_tracked=2)
    for key in ["a", "b", "c"]:
        tracker.observe("t", "m", key, config)
    assert sorted(k for k, _ in tracker.top(config)[0]) == ["b", "c"]


def test_the_snapshot_shows_shares_and_a_preview_only_when_allowed():
    tracker = Tracker(Clock())
    shown = FingerprintConfig(preview=True, preview_chars=5)
    tracker.observe("t", "m", "a", shown, lambda: "You are a helpful assistant")
    tracker.observe("t", "m", "a", shown)
    tracker.observe("t", "m", "b", shown, lambda: "Other")
    rows = tracker.snapshot(shown)["fingerprints"]
    assert [(r["fingerprint"], r["share"], r["preview"]) for r in rows] == [
        ("a", 0.6667, "You a"), ("b", 0.3333, "Other")]
    assert "preview" not in tracker.snapshot(FingerprintConfig())["fingerprints"][0]
