"""Canonical JSON and the structural rules, on tables of cases."""

from __future__ import annotations

import orjson
import pytest

from tests.normalize.helpers import chat, run, system, user

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}},
    "required": ["b"]}}}
SHUFFLED = {"function": {"parameters": {"required": ["b"], "properties": {
    "a": {"type": "integer"}, "b": {"type": "string"}}, "type": "object"}, "name": "f"},
    "type": "function"}


def test_tools_in_any_key_order_become_the_same_bytes():
    one = run(chat(user("q"), tools=[TOOL]), "canonical_json").request.body["tools"]
    two = run(chat(user("q"), tools=[SHUFFLED]), "canonical_json").request.body["tools"]
    assert orjson.dumps(one) == orjson.dumps(two)
    assert one[0] == TOOL  # the same JSON value: only the order changed


def test_legacy_functions_are_canonical_too():
    out = run(chat(user("q"), functions=[{"name": "f", "description": "d"}]), "canonical_json")
    assert list(out.request.body["functions"][0]) == ["description", "name"]


def test_response_format_keys_are_sorted_but_schema_property_order_is_kept():
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"},
                                               "answer": {"type": "string"}}}
    response_format = {"type": "json_schema", "json_schema": {"schema": schema, "name": "a"}}
    out = run(chat(user("q"), response_format=response_format), "canonical_json")
    body = out.request.body["response_format"]
    assert list(body["json_schema"]) == ["name", "schema"]
    assert list(body["json_schema"]["schema"]["properties"]) == ["reasoning", "answer"]


@pytest.mark.parametrize("fields", [
    {"tools": [{"function": {"name": "f"}, "type": "function"}]},  # already sorted
    {"response_format": {"type": "json_object"}},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}},  # not a schema
    {},
])
def test_canonical_json_leaves_sorted_or_unrelated_fields_alone(fields):
    parsed = chat(user("q"), **fields)
    assert run(parsed, "canonical_json").request is parsed


def test_system_messages_move_first_in_their_order():
    parsed = chat(user("u1"), system("s1"), {"role": "assistant", "content": "a"}, system("s2"))
    messages = run(parsed, "system_first").request.messages
    assert [m["content"] for m in messages] == ["s1", "s2", "u1", "a"]


def test_system_first_leaves_a_conversation_that_already_starts_with_them():
    parsed = chat(system("s1"), system("s2"), user("u"))
    assert run(parsed, "system_first").request is parsed


def test_consecutive_system_messages_merge_with_a_blank_line():
    parsed = chat(system("s1"), system([{"type": "text", "text": "s2"}]), user("u"), system("s3"))
    result = run(parsed, "merge_system")
    assert result.request.messages[:2] == [system("s1\n\ns2"), user("u")]
    assert result.request.messages[2] == system("s3")  # not consecutive: kept apart
    assert result.tally.edits == {"merge_system": 1}


def test_merging_an_empty_system_message_adds_no_blank_lines():
    parsed = chat(system(""), system("s"), system(""), user("u"))
    assert run(parsed, "merge_system").request.messages == [system("s"), user("u")]


def test_a_system_message_with_a_name_is_never_merged():
    parsed = chat(system("s1"), {"role": "system", "content": "s2", "name": "policy"}, user("u"))
    assert run(parsed, "merge_system").request is parsed
