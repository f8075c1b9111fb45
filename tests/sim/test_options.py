"""Parsing what a request asks of its choices: pure, no server."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.sim.options import (
    OptionError,
    OutputOptions,
    chat_options,
    completion_options,
)

TOOLS = [{"type": "function", "function": {"name": "a"}}, {"function": {"name": "b"}}]


def test_a_body_without_extras_is_plain_single_choice() -> None:
    assert chat_options({}) == completion_options({}) == OutputOptions()
    assert OutputOptions().plain
    assert OutputOptions(n=4).plain
    assert not OutputOptions(logprobs=0).plain


def test_chat_logprobs_count_the_alternatives_asked_for() -> None:
    assert chat_options({"logprobs": True}).logprobs == 0
    assert chat_options({"logprobs": True, "top_logprobs": 5}).logprobs == 5
    assert chat_options({"logprobs": False}).logprobs is None
    assert chat_options({"top_logprobs": 0}).logprobs is None  # vLLM allows 0 alone


def test_completions_best_of_defaults_to_n() -> None:
    assert completion_options({"n": 3}) == OutputOptions(n=3, best_of=3)
    assert completion_options({"n": 2, "best_of": 6}).best_of == 6
    assert chat_options({"n": 2, "best_of": 6}).best_of == 2  # chat has no best_of


def test_tool_choice_names_a_function_from_tools() -> None:
    named = {"type": "function", "function": {"name": "b"}}
    assert chat_options({"tools": TOOLS, "tool_choice": named}).tool_name == "b"
    assert chat_options({"tools": TOOLS, "tool_choice": "required"}).tool_name == "a"
    for choice in ("auto", "none", None):
        assert chat_options({"tools": TOOLS, "tool_choice": choice}).tool_name is None


def test_json_formats_make_json_content() -> None:
    assert chat_options({"response_format": {"type": "json_object"}}).json_content
    assert completion_options({"response_format": {"type": "json_schema"}}).json_content
    assert not chat_options({"response_format": {"type": "text"}}).json_content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": True}, "n"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "z"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)  # fmt: skip
def test_chat_values_vllm_refuses_name_their_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OptionError) as info:
        chat_options(body)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"best_of": 0}, "best_of"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 2.0}, "logprobs"),
        ({"response_format": "json"}, "response_format"),
    ],
)
def test_completion_values_vllm_refuses_name_their_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OptionError) as info:
        completion_options(body)
    assert info.value.param == param
