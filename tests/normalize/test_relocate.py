"""Dynamic content out of the system prompt: what each pattern moves, where the value goes,
and what it must not touch."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvgate.normalize.config import RelocationConfig
from kvgate.normalize.relocate import compile_patterns
from tests.normalize.helpers import chat, run, system, user

ALL = RelocationConfig(patterns=["timestamp", "date", "request_id", "user_name"])


def relocate(parsed, config=ALL):
    return run(parsed, "relocate_dynamic", patterns=compile_patterns(config), target=config.target)


@pytest.mark.parametrize(("text", "static", "note"), [
    ("Now: 2026-11-29T10:03Z. Be brief.", "Now: [timestamp]. Be brief.",
     "timestamp: 2026-11-29T10:03Z"),
    ("At 2026-11-29 10:03:05+01:00 exactly", "At [timestamp] exactly",
     "timestamp: 2026-11-29 10:03:05+01:00"),
    ("Today is November 29, 2026.", "Today is [date].", "date: November 29, 2026"),
    ("Today is 29 Nov 2026.", "Today is [date].", "date: 29 Nov 2026"),
    ("Date: 2026-11-29", "Date: [date]", "date: 2026-11-29"),
    ("Request id: abc123XYZ, be kind", "Request id: [request_id], be kind",
     "request_id: abc123XYZ"),
    ("trace 123e4567-e89b-12d3-a456-426614174000 end", "trace [request_id] end",
     "request_id: 123e4567-e89b-12d3-a456-426614174000"),
    ("The user's name is Ada Lovelace. Greet them.", "The user's name is [user_name]. Greet them.",
     "user_name: Ada Lovelace"),
    ("You are talking to Grace.", "You are talking to [user_name].", "user_name: Grace"),
])
def test_each_builtin_pattern_moves_its_value_and_leaves_a_placeholder(text, static, note):
    result = relocate(chat(system(text), user("q")))
    messages = result.request.messages
    assert messages[0]["content"] == static
    assert messages[1]["content"] == f"q\n\n[moved from the system prompt] {note}"
    assert result.tally.edits["relocate_dynamic"] == 1


@pytest.mark.parametrize("text", [
    "Version 2.3.1 of the API, port 8080, 30 days to return.",
    "the user is asked to log in",  # lower case: not a name
    "Call the tool named Search.",
    "Prices in 2026 start at 10 EUR.",
])
def test_static_text_is_not_mistaken_for_dynamic_content(text):
    parsed = chat(system(text), user("q"))
    assert relocate(parsed).request is parsed


def test_only_the_leading_system_messages_are_searched():
    parsed = chat(system("static"), user("Today is 2026-11-29"), system("At 2026-11-29"))
    assert relocate(parsed).request is parsed


def test_several_values_go_into_one_note_in_order():
    parsed = chat(system("User: Ada. Now: 2026-11-29T10:03Z."), system("id: x"), user("q"))
    messages = relocate(parsed).request.messages
    assert messages[0]["content"] == "User: [user_name]. Now: [timestamp]."
    assert messages[2]["content"].endswith(
        "[moved from the system prompt] timestamp: 2026-11-29T10:03Z; user_name: Ada")


def test_the_note_is_a_text_part_when_the_user_message_has_parts():
    image = {"type": "image_url", "image_url": {"url": "data:,x"}}
    parsed = chat(system("At 2026-11-29"), user([image]))
    parts = relocate(parsed).request.messages[1]["content"]
    assert parts == [image, {"type": "text", "text": "[moved from the system prompt] date: 2026-11-29"}]


def test_the_system_note_target_appends_a_final_system_message():
    config = RelocationConfig(patterns=["date"], target="system_note")
    messages = relocate(chat(system("At 2026-11-29"), user("q")), config).request.messages
    assert messages[-1] == system("[moved from the system prompt] date: 2026-11-29")
    assert messages[1] == user("q")


def test_without_a_user_message_the_note_is_a_final_system_message():
    messages = relocate(chat(system("At 2026-11-29"))).request.messages
    assert messages == [system("At [date]"), system("[moved from the system prompt] date: 2026-11-29")]


def test_a_named_regex_moves_only_its_value_group():
    config = RelocationConfig(patterns=[{"name": "order", "regex": r"order #(?P<value>\d+)"}])
    messages = relocate(chat(system("About order #12345."), user("q")), config).request.messages
    assert messages[0]["content"] == "About order #[order]."
    assert messages[1]["content"].endswith("order: 12345")


@pytest.mark.parametrize(("patterns", "error"), [
    (["timestamps"], "unknown pattern"),
    ([{"name": "x", "regex": "("}], "not a valid regex"),
    ([{"name": "x", "regex": r"\d*"}], "matches the empty string"),
    ([{"name": "x", "regex": r"\[\w+\]"}], "matches the placeholder"),
    (["date", {"name": "date", "regex": "d"}], "unique"),
])
def test_bad_patterns_are_refused_at_load(patterns, error):
    with pytest.raises(ValidationError, match=error):
        RelocationConfig(patterns=patterns)
