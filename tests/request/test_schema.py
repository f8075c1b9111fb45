"""Request validation: every field the OpenAI API defines is checked by type and range before
anything is forwarded; fields nobody knows pass through untouched."""

from __future__ import annotations

import orjson
import pytest

from kvgate.errors import BadRequest
from kvgate.request.parsed import Endpoint, parse_body
from tests.request.vectors import REFUSED, USER_HI, nested
from tests.request.vectors import chat_bytes as chat
from tests.request.vectors import completion_bytes as completion


@pytest.mark.parametrize(
    ("endpoint", "raw", "param"), [pytest.param(*case[1:], id=case[0]) for case in REFUSED]
)
def test_a_known_field_of_the_wrong_type_or_range_is_refused_naming_it(
    endpoint: Endpoint, raw: bytes, param: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_body(raw, endpoint)
    assert caught.value.param == param, caught.value.message
    assert caught.value.status == 400


ACCEPTED: list[tuple[str, Endpoint, bytes]] = [
    ("sampling", Endpoint.CHAT,
     chat(temperature=0, top_p=1, seed=-1, stop=["\n"], presence_penalty=-2.0,
          frequency_penalty=2, logit_bias={"1": -100}, top_k=-1, min_p=0.1)),
    ("tools", Endpoint.CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=False)),
    ("tool-choice-word", Endpoint.CHAT, chat(tool_choice="required")),
    ("logprobs", Endpoint.CHAT, chat(logprobs=True, top_logprobs=20)),
    ("response-format", Endpoint.CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})),
    ("every-role", Endpoint.CHAT, chat(messages=[
        {"role": r, "content": "x"} for r in
        ("system", "developer", "user", "assistant", "tool", "function")])),
    ("nulls-mean-defaults", Endpoint.CHAT,
     chat(temperature=None, stop=None, tools=None, tool_choice=None, seed=None)),
    ("completions", Endpoint.COMPLETIONS, completion(logprobs=5, echo=True, suffix="!")),
    ("vllm-priority-lowered-by-client", Endpoint.CHAT, chat(priority=3)),
    ("chat-echo", Endpoint.CHAT, chat(echo=True)),
    ("nesting-254-levels-with-the-body", Endpoint.CHAT, chat(vendor_extension=nested(252))),
]


@pytest.mark.parametrize(
    ("endpoint", "raw"), [pytest.param(*case[1:], id=case[0]) for case in ACCEPTED]
)
def test_valid_fields_are_accepted(endpoint: Endpoint, raw: bytes) -> None:
    parse_body(raw, endpoint)


def test_unknown_fields_pass_through_untouched() -> None:
    extras = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False},
              "guided_json": {"type": "object"}, "future_field": [1, "two", None]}
    parsed = parse_body(chat(**extras), Endpoint.CHAT)
    for name, value in extras.items():
        assert parsed.body[name] == value
    assert orjson.loads(chat(**extras)) == parsed.body


def test_more_messages_than_the_limit_is_a_400_naming_the_limit() -> None:
    raw = chat(messages=USER_HI * 11)
    with pytest.raises(BadRequest) as caught:
        parse_body(raw, Endpoint.CHAT, max_messages=10)
    assert caught.value.param == "messages" and caught.value.code == "too_many_messages"
    assert "at most 10" in caught.value.message
    parse_body(chat(messages=USER_HI * 10), Endpoint.CHAT, max_messages=10)


def test_more_batched_prompts_than_the_limit_is_a_400() -> None:
    with pytest.raises(BadRequest) as caught:
        parse_body(completion(prompt=["a"] * 11), Endpoint.COMPLETIONS, max_messages=10)
    assert caught.value.param == "prompt"
    # one prompt of many token ids is one prompt
    parse_body(completion(prompt=list(range(100))), Endpoint.COMPLETIONS, max_messages=10)
