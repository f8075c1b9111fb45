"""Request validation: every field the OpenAI API defines is checked by type and range before
anything is forwarded; fields nobody knows pass through untouched."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from kvgate.errors import BadRequest
from kvgate.request.parsed import Endpoint, parse_body

USER_HI = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": USER_HI, **fields}).encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def nested(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"x": value}
    return value


# (id, endpoint, body, param)
REFUSED: list[tuple[str, Endpoint, bytes, str]] = [
    ("temperature-string", Endpoint.CHAT, chat(temperature="hot"), "temperature"),
    ("temperature-above-2", Endpoint.CHAT, chat(temperature=2.5), "temperature"),
    ("temperature-negative", Endpoint.CHAT, chat(temperature=-0.1), "temperature"),
    ("temperature-bool", Endpoint.CHAT, chat(temperature=True), "temperature"),
    ("top-p-above-1", Endpoint.CHAT, chat(top_p=1.5), "top_p"),
    ("stop-number", Endpoint.CHAT, chat(stop=5), "stop"),
    ("stop-list-of-numbers", Endpoint.CHAT, chat(stop=["a", 5]), "stop[1]"),
    ("logprobs-int-on-chat", Endpoint.CHAT, chat(logprobs=3), "logprobs"),
    ("top-logprobs-over-20", Endpoint.CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top-logprobs-without-logprobs", Endpoint.CHAT, chat(top_logprobs=2), "top_logprobs"),
    ("tools-object", Endpoint.CHAT, chat(tools={"type": "function"}), "tools"),
    ("tool-without-type", Endpoint.CHAT, chat(tools=[{"function": {"name": "f"}}]), "tools[0].type"),
    ("tool-function-without-name", Endpoint.CHAT,
     chat(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0].function.name"),
    ("tool-parameters-list", Endpoint.CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools[0].function.parameters"),
    ("tool-choice-unknown-word", Endpoint.CHAT, chat(tool_choice="always"), "tool_choice"),
    ("tool-choice-number", Endpoint.CHAT, chat(tool_choice=1), "tool_choice"),
    ("response-format-string", Endpoint.CHAT, chat(response_format="json"), "response_format"),
    ("response-format-without-type", Endpoint.CHAT, chat(response_format={}),
     "response_format.type"),
    ("seed-string", Endpoint.CHAT, chat(seed="1"), "seed"),
    ("seed-beyond-int64", Endpoint.CHAT, chat(seed=2**64), "seed"),
    ("presence-penalty-above-2", Endpoint.CHAT, chat(presence_penalty=3), "presence_penalty"),
    ("frequency-penalty-string", Endpoint.CHAT, chat(frequency_penalty="0"), "frequency_penalty"),
    ("logit-bias-list", Endpoint.CHAT, chat(logit_bias=[1]), "logit_bias"),
    ("logit-bias-out-of-range", Endpoint.CHAT, chat(logit_bias={"50256": 101}), "logit_bias.50256"),
    ("stream-options-include-usage-string", Endpoint.CHAT,
     chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    ("role-unknown", Endpoint.CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]),
     "messages[0].role"),
    ("tool-call-function-not-object", Endpoint.CHAT,
     chat(messages=[*USER_HI, {"role": "assistant", "tool_calls": [{"function": 5}]}]),
     "messages[1].tool_calls[0].function"),
    ("parallel-tool-calls-string", Endpoint.CHAT, chat(parallel_tool_calls="yes"),
     "parallel_tool_calls"),
    ("completions-empty-prompt", Endpoint.COMPLETIONS, completion(prompt=""), "prompt"),
    ("completions-empty-prompt-in-batch", Endpoint.COMPLETIONS, completion(prompt=["a", ""]),
     "prompt"),
    ("completions-logprobs-bool", Endpoint.COMPLETIONS, completion(logprobs=True), "logprobs"),
    ("completions-logprobs-over-20", Endpoint.COMPLETIONS, completion(logprobs=21), "logprobs"),
    ("completions-echo-string", Endpoint.COMPLETIONS, completion(echo="no"), "echo"),
    # vLLM's chat takes echo too (a bool): the fuzzer found a list forwarded
    ("chat-echo-list", Endpoint.CHAT, chat(echo=[]), "echo"),
    ("completions-suffix-number", Endpoint.COMPLETIONS, completion(suffix=1), "suffix"),
    ("vllm-priority-raised-by-client", Endpoint.CHAT, chat(priority=-100), "priority"),
    ("vllm-priority-not-an-integer", Endpoint.CHAT, chat(priority="high"), "priority"),
    # orjson reads 1024 levels but writes 254: deeper could be parsed, never forwarded
    ("unknown-field-nested-300-deep", Endpoint.CHAT, chat(vendor_extension=nested(300)),
     "vendor_extension"),
    ("content-part-nested-300-deep", Endpoint.CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "x", "x": nested(300)}]}]),
     "messages"),
]


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
