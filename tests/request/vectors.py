"""Request bodies that must be refused, shared by the tests of the parser and the front
(tests/request) and of the gateway end to end (tests/gateway/test_bad_requests.py).

    REFUSALS: (id, path, body, status, code, param), refused at the front door
    REFUSED:  (id, endpoint, raw body, param), a known field of the wrong type or range
"""

from __future__ import annotations

import json
from typing import Any

from kvgate.request.parsed import Endpoint
from tests.plugins.bodies import chat

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER_HI = [{"role": "user", "content": "hi"}]


def chat_bytes(**fields: Any) -> bytes:
    """A chat body for model "m", as `json.dumps` writes it."""
    return json.dumps({"model": "m", "messages": USER_HI, **fields}).encode()


def completion_bytes(**fields: Any) -> bytes:
    """A completions body for model "m", as `json.dumps` writes it."""
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def nested(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"x": value}
    return value


# (id, path, body, status, code, param)
REFUSALS: list[tuple[str, str, Any, int, str | None, str | None]] = [
    ("malformed-json", CHAT, b'{"model": "stub-model", ', 400, None, None),
    ("empty-body", CHAT, b"", 400, None, None),
    ("array-body", CHAT, b"[1, 2]", 400, None, None),
    ("string-body", CHAT, b'"hello"', 400, None, None),
    ("null-body", CHAT, b"null", 400, None, None),
    ("missing-model", CHAT, {"messages": USER_HI}, 400, None, "model"),
    ("empty-model", CHAT, chat(model=""), 400, None, "model"),
    ("model-not-string", CHAT, chat(model=7), 400, None, "model"),
    ("missing-messages", CHAT, {"model": "stub-model"}, 400, None, "messages"),
    ("missing-prompt", COMPLETIONS, {"model": "stub-model"}, 400, None, "prompt"),
    ("messages-not-list", CHAT, chat(messages="hi"), 400, None, "messages"),
    ("messages-empty", CHAT, chat(messages=[]), 400, None, "messages"),
    ("message-not-object", CHAT, chat(messages=["hi"]), 400, None, "messages[0]"),
    ("role-missing", CHAT, chat(messages=[{"content": "hi"}]), 400, None, "messages[0].role"),
    ("content-number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, None,
     "messages[0].content"),
    ("content-object", CHAT, chat(messages=[{"role": "user", "content": {"text": "hi"}}]), 400,
     None, "messages[0].content"),
    ("stream-string", CHAT, chat(stream="yes"), 400, None, "stream"),
    ("stream-options-string", CHAT, chat(stream=True, stream_options="x"), 400, None,
     "stream_options"),
    ("max-tokens-string", CHAT, chat(max_tokens="5"), 400, None, "max_tokens"),
    ("max-tokens-bool", CHAT, chat(max_tokens=True), 400, None, "max_tokens"),
    ("max-tokens-float", CHAT, chat(max_tokens=5.0), 400, None, "max_tokens"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, None, "max_tokens"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-3), 400, None, "max_tokens"),
    ("max-tokens-absurd", CHAT, chat(max_tokens=10**9), 400, None, "max_tokens"),
    ("max-completion-tokens-string", CHAT, chat(max_completion_tokens="9"), 400, None,
     "max_completion_tokens"),
    ("user-not-string", CHAT, chat(user=5), 400, None, "user"),
    ("unknown-model", CHAT, chat(model="no-such-model"), 404, "model_not_found", "model"),
    ("unknown-model-completions", COMPLETIONS,
     {"model": "no-such-model", "prompt": "hi", "max_tokens": 5}, 404, "model_not_found", "model"),
    # The stub reports max_model_len 4096.
    ("prompt-plus-max-tokens-over-context", CHAT, chat(max_tokens=4095), 400,
     "context_length_exceeded", "max_tokens"),
    # vLLM reads max_completion_tokens first: a small max_tokens beside it bounds nothing,
    # and the error names the field that was too large.
    ("max-completion-tokens-over-context-beside-small-max-tokens", CHAT,
     chat(max_tokens=5, max_completion_tokens=4095), 400, "context_length_exceeded",
     "max_completion_tokens"),
    ("completions-over-context", COMPLETIONS,
     {"model": "stub-model", "prompt": "hello there", "max_tokens": 4095}, 400,
     "context_length_exceeded", "max_tokens"),
    ("prompt-alone-over-context", CHAT,
     {"model": "stub-model", "messages": [{"role": "user", "content": "word " * 5000}]}, 400,
     "context_length_exceeded", "messages"),
]


# (id, endpoint, body, param)
REFUSED: list[tuple[str, Endpoint, bytes, str]] = [
    ("temperature-string", Endpoint.CHAT, chat_bytes(temperature="hot"), "temperature"),
    ("temperature-above-2", Endpoint.CHAT, chat_bytes(temperature=2.5), "temperature"),
    ("temperature-negative", Endpoint.CHAT, chat_bytes(temperature=-0.1), "temperature"),
    ("temperature-bool", Endpoint.CHAT, chat_bytes(temperature=True), "temperature"),
    ("top-p-above-1", Endpoint.CHAT, chat_bytes(top_p=1.5), "top_p"),
    ("stop-number", Endpoint.CHAT, chat_bytes(stop=5), "stop"),
    ("stop-list-of-numbers", Endpoint.CHAT, chat_bytes(stop=["a", 5]), "stop[1]"),
    ("logprobs-int-on-chat", Endpoint.CHAT, chat_bytes(logprobs=3), "logprobs"),
    ("top-logprobs-over-20", Endpoint.CHAT, chat_bytes(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top-logprobs-without-logprobs", Endpoint.CHAT, chat_bytes(top_logprobs=2), "top_logprobs"),
    ("tools-object", Endpoint.CHAT, chat_bytes(tools={"type": "function"}), "tools"),
    ("tool-without-type", Endpoint.CHAT, chat_bytes(tools=[{"function": {"name": "f"}}]), "tools[0].type"),
    ("tool-function-without-name", Endpoint.CHAT,
     chat_bytes(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0].function.name"),
    ("tool-parameters-list", Endpoint.CHAT,
     chat_bytes(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools[0].function.parameters"),
    ("tool-choice-unknown-word", Endpoint.CHAT, chat_bytes(tool_choice="always"), "tool_choice"),
    ("tool-choice-number", Endpoint.CHAT, chat_bytes(tool_choice=1), "tool_choice"),
    ("response-format-string", Endpoint.CHAT, chat_bytes(response_format="json"), "response_format"),
    ("response-format-without-type", Endpoint.CHAT, chat_bytes(response_format={}),
     "response_format.type"),
    ("seed-string", Endpoint.CHAT, chat_bytes(seed="1"), "seed"),
    ("seed-beyond-int64", Endpoint.CHAT, chat_bytes(seed=2**64), "seed"),
    ("presence-penalty-above-2", Endpoint.CHAT, chat_bytes(presence_penalty=3), "presence_penalty"),
    ("frequency-penalty-string", Endpoint.CHAT, chat_bytes(frequency_penalty="0"), "frequency_penalty"),
    ("logit-bias-list", Endpoint.CHAT, chat_bytes(logit_bias=[1]), "logit_bias"),
    ("logit-bias-out-of-range", Endpoint.CHAT, chat_bytes(logit_bias={"50256": 101}), "logit_bias.50256"),
    ("stream-options-include-usage-string", Endpoint.CHAT,
     chat_bytes(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    ("role-unknown", Endpoint.CHAT, chat_bytes(messages=[{"role": "wizard", "content": "hi"}]),
     "messages[0].role"),
    ("tool-call-function-not-object", Endpoint.CHAT,
     chat_bytes(messages=[*USER_HI, {"role": "assistant", "tool_calls": [{"function": 5}]}]),
     "messages[1].tool_calls[0].function"),
    ("parallel-tool-calls-string", Endpoint.CHAT, chat_bytes(parallel_tool_calls="yes"),
     "parallel_tool_calls"),
    ("completions-empty-prompt", Endpoint.COMPLETIONS, completion_bytes(prompt=""), "prompt"),
    ("completions-empty-prompt-in-batch", Endpoint.COMPLETIONS, completion_bytes(prompt=["a", ""]),
     "prompt"),
    ("completions-logprobs-bool", Endpoint.COMPLETIONS, completion_bytes(logprobs=True), "logprobs"),
    ("completions-logprobs-over-20", Endpoint.COMPLETIONS, completion_bytes(logprobs=21), "logprobs"),
    ("completions-echo-string", Endpoint.COMPLETIONS, completion_bytes(echo="no"), "echo"),
    # vLLM's chat takes echo too (a bool): the fuzzer found a list forwarded
    ("chat-echo-list", Endpoint.CHAT, chat_bytes(echo=[]), "echo"),
    ("completions-suffix-number", Endpoint.COMPLETIONS, completion_bytes(suffix=1), "suffix"),
    ("vllm-priority-raised-by-client", Endpoint.CHAT, chat_bytes(priority=-100), "priority"),
    ("vllm-priority-not-an-integer", Endpoint.CHAT, chat_bytes(priority="high"), "priority"),
    # orjson reads 1024 levels but writes 254: deeper could be parsed, never forwarded
    ("unknown-field-nested-300-deep", Endpoint.CHAT, chat_bytes(vendor_extension=nested(300)),
     "vendor_extension"),
    ("content-part-nested-300-deep", Endpoint.CHAT,
     chat_bytes(messages=[{"role": "user", "content": [{"type": "x", "x": nested(300)}]}]),
     "messages"),
]
