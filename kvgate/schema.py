"""The OpenAI request fields kvgate knows, declared once and checked before anything is forwarded.

`kvgate.requests` reads the fields kvgate itself interprets (model, messages, prompt, stream,
max_tokens, n, user); this module checks every other field the OpenAI API defines, by type and
range, whether or not kvgate reads it — a replica should never be the first to see
`temperature: "hot"`. The models allow extra fields: whatever OpenAI or vLLM adds later
(`ignore_eos`, `chat_template_kwargs`, `guided_json`, ...) passes through untouched. The client's
body is validated, never rebuilt: what is forwarded is the dict the client sent.

Two bounds that are not OpenAI's but kvgate's own:

- nesting: orjson reads 1024 levels but writes at most 254, so anything deeper could be parsed
  but not forwarded. `check_encodable` finds out at parse time (one serialization, in C) and
  refuses with a 400 naming the top-level field.
- message count: `max_messages` (config `server.max_messages`) keeps the per-message work of one
  request bounded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvgate.errors import BadRequest

# OpenAI's roles; "function" is the deprecated form of "tool", "developer" the o-series system.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
INT64 = 2**63 - 1
# The deepest nesting orjson writes (a body is one level: {"tools": [{...}]} is three).
MAX_DEPTH = 254

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Penalty = Annotated[float, Field(strict=True, ge=-2.0, le=2.0)]


class _Open(BaseModel):
    """Strict on the fields it names (no "1" for 1, no 1 for true); extra fields allowed."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class FunctionDef(_Open):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Open):
    type: StrictStr
    function: FunctionDef | None = None


class NamedFunction(_Open):
    name: StrictStr = Field(min_length=1)


class ToolChoice(_Open):
    type: StrictStr
    function: NamedFunction | None = None


class ToolCallFunction(_Open):
    name: StrictStr | None = None
    arguments: StrictStr | None = None


class ToolCall(_Open):
    id: StrictStr | None = None
    type: StrictStr | None = None
    function: ToolCallFunction | None = None


class Message(_Open):
    role: Role
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None


class ResponseFormat(_Open):
    type: StrictStr
    json_schema: dict[str, Any] | None = None


class StreamOptions(_Open):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _Sampling(_Open):
    """Fields both endpoints share."""

    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[int, Field(strict=True, ge=-INT64 - 1, le=INT64)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100, le=100)]] | None = None
    stream_options: StreamOptions | None = None
    # vLLM's sampling extensions that a bad type would make it reject anyway
    top_k: StrictInt | None = None
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(strict=True, gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None


class ChatRequest(_Sampling):
    messages: list[Message]
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None


def validate(body: dict[str, Any], chat: bool) -> None:
    """Raise BadRequest naming the first field that is not what the OpenAI API allows."""
    model = ChatRequest if chat else CompletionRequest
    try:
        model.model_validate(body)
    except ValidationError as exc:
        # within a union, the branch that got furthest says most: ["a", 5] is a list of
        # strings with a bad second item, not a bad string
        errors = exc.errors(include_url=False, include_input=False)
        error = max(errors, key=lambda e: len(_param(e["loc"])))
        param = _param(error["loc"])
        raise BadRequest(f"'{param}': {_message(error)}", param=param) from None
    if chat and body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")


def check_encodable(body: dict[str, Any]) -> None:
    """Refuse what kvgate could parse but not forward: nesting past orjson's writer."""
    try:
        orjson.dumps(body)
        return
    except orjson.JSONEncodeError:
        pass
    culprit = next((k for k, v in body.items() if not _encodable(v)), None)
    raise BadRequest(
        f"'{culprit}' is nested more than {MAX_DEPTH} levels deep" if culprit
        else f"the request body is nested more than {MAX_DEPTH} levels deep",
        param=culprit,
    )


def check_count(messages: Any, max_messages: int, param: str) -> None:
    if isinstance(messages, list) and len(messages) > max_messages:
        raise BadRequest(
            f"'{param}' has {len(messages)} entries; at most {max_messages} are accepted",
            param=param, code="too_many_messages",
        )


def _encodable(value: Any) -> bool:
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param(loc: tuple[int | str, ...]) -> str:
    """('tools', 0, 'function', 'name') -> 'tools[0].function.name'; union branch tags (the
    names of the alternative types pydantic tried) are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper():
            continue
        else:
            out += f".{part}" if out else part
    return out


def _message(error: Any) -> str:
    message = str(error["msg"])
    return message[:1].lower() + message[1:]
