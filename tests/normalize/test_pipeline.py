"""The pipeline: which texts the rules read, copy-on-write, the edits it reports."""

from __future__ import annotations

import copy

import orjson

from kvgate.normalize.config import SAFE_RULES
from kvgate.normalize.pipeline import RULES, CleanTexts, Settings, normalize
from tests.normalize.helpers import chat, completion, run, system, user


def test_rules_run_in_the_configured_order_text_rules_first():
    names = [r.name for r in RULES]
    assert names[: len(SAFE_RULES) - 1] == list(SAFE_RULES[:-1])
    text = [i for i, r in enumerate(RULES) if r.text is not None]
    assert text == list(range(len(text)))  # one walk over the texts does them all


def test_system_user_and_assistant_texts_are_normalized_in_strings_and_parts():
    parsed = chat(
        system("be brief  \r\n"),
        user([{"type": "text", "text": "look\u200b "},
              {"type": "image_url", "image_url": {"url": "data:,x  "}}]),
        {"role": "assistant", "content": "ok  "},
    )
    messages = run(parsed).request.messages
    assert messages[0]["content"] == "be brief"
    assert messages[1]["content"][0] == {"type": "text", "text": "look"}
    assert messages[1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:,x  "}}
    assert messages[2]["content"] == "ok"


def test_tool_messages_tool_calls_and_names_are_untouched():
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"b\": 1,  \"a\": 2}  "}}
    parsed = chat(
        user("q"),
        {"role": "assistant", "content": None, "tool_calls": [call], "name": "bot  "},
        {"role": "tool", "tool_call_id": "c1", "content": "  out  \r\n"},
    )
    result = run(parsed)
    assert result.request is parsed
    assert not result.changed


def test_completion_prompts_are_normalized_but_token_ids_are_not():
    assert run(completion("text  \r\n")).request.body["prompt"] == "text"
    batch = run(completion(["a ", "b"])).request.body["prompt"]
    assert batch == ["a", "b"]
    ids = completion([1, 2, 3])
    assert run(ids).request is ids


def test_the_clients_body_is_never_modified():
    parsed = chat(system("x  "), user("y\r\n"), tools=[{"type": "function",
                                                       "function": {"name": "f"}}])
    before = copy.deepcopy(parsed.body)
    result = run(parsed, *SAFE_RULES, "relocate_dynamic", "merge_system", "system_first")
    assert result.request is not parsed
    assert parsed.body == before
    assert orjson.dumps(parsed.body) == orjson.dumps(before)


def test_edits_and_changed_bytes_are_reported_per_rule():
    result = run(chat(system("a  \r\nb  "), user("c\u200b")))
    assert result.tally.edits == {"line_endings": 1, "trailing_whitespace": 1,
                                  "invisible_characters": 1}
    assert result.tally.changed["trailing_whitespace"] == 4  # two blanks on each of two lines
    assert result.tally.changed["invisible_characters"] == 3  # U+200B is three bytes


def test_a_known_clean_text_is_not_checked_again_but_gives_the_same_answer():
    clean = CleanTexts(min_chars=8)
    settings = Settings.of(SAFE_RULES)
    parsed = chat(system("a long enough system prompt"), user("q"))
    first = normalize(parsed, settings, clean)
    second = normalize(parsed, settings, clean)
    assert first.request is parsed and second.request is parsed
    assert ((tuple(r.name for r in settings.text_rules), True, "a long enough system prompt")
            in clean)


def test_an_unknown_rule_name_is_refused():
    import pytest

    with pytest.raises(ValueError, match="unknown rules"):
        Settings.of(["line_endings", "spellcheck"])
