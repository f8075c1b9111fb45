"""The OpenAI request fields kvgate knows, declared once and checked before anything is forwarded.

The one validator of a request body. It checks the fields kvgate itself interprets (model,
messages, prompt, stream, stream_options, max_tokens, n, user, priority; their refusals are
kvgate's own words, in `kvgate.request.rules`) and every other field the OpenAI API defines, by
type and range, whether or not kvgate reads it — a replica should never be the first to see
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
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    WrapValidator,
    model_validator,
)

from kvgate.error_path import error_path
from kvgate.errors import BadRequest
from kvgate.request import rules

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
    """Fields in the order kvgate's own checks read them: the first refusal is the one named."""

    role: Annotated[Role | None, BeforeValidator(rules.required_string)] = Field(
        None, validate_default=True
    )
    content: Annotated[Any, BeforeValidator(rules.content)] = None
    name: Annotated[StrictStr | None, BeforeValidator(rules.string)] = None
    tool_calls: Annotated[list[ToolCall] | None, BeforeValidator(rules.objects)] = None
    tool_call_id: StrictStr | None = None


class ResponseFormat(_Open):
    type: StrictStr
    json_schema: dict[str, Any] | None = None


class StreamOptions(_Open):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _Sampling(_Open):
    """Fields both endpoints share. kvgate's own (model ... user) are refused in kvgate's words,
    before any other field's refusal; `n` and `best_of` after all others (see `rules`)."""

    model: Annotated[str, BeforeValidator(rules.model)] = Field("", validate_default=True)
    priority: Annotated[int | None, BeforeValidator(rules.priority)] = None
    stream: Annotated[StrictBool | None, BeforeValidator(rules.boolean)] = None
    stream_options: Annotated[StreamOptions | None, BeforeValidator(rules.mapping)] = None
    max_completion_tokens: Annotated[int | None, BeforeValidator(rules.token_limit)] = None
    max_tokens: Annotated[int | None, BeforeValidator(rules.token_limit)] = None
    user: Annotated[StrictStr | None, BeforeValidator(rules.string)] = None
    n: Any = None  # checked by `sequences`, after every other field
    best_of: Any = None

    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[int, Field(strict=True, ge=-INT64 - 1, le=INT64)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100, le=100)]] | None = None
    # vLLM's sampling extensions that a bad type would make it reject anyway
    top_k: StrictInt | None = None
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(strict=True, gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None
    ignore_eos: StrictBool | None = None  # with min_tokens, says how long the answer will be

    @property
    def token_limit(self) -> int | None:
        """The completion limit vLLM will apply: it reads `max_completion_tokens or max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def client_wants_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage is True

    @property
    def sequences(self) -> int:
        """n (or best_of): sequences generated in parallel, each up to the token limit."""
        return max(1, self.n or 1, self.best_of or 1)

    def _check_together(self) -> None:
        limit, minimum = self.token_limit, self.min_tokens
        if limit is not None and minimum is not None and minimum > limit:
            # vLLM refuses it too; admission reads min_tokens as what the answer will write
            raise rules.refuse(
                f" ({minimum}) must not exceed max_tokens ({limit})", param="min_tokens"
            )
        for field in ("n", "best_of"):
            rules.sequences(getattr(self, field), field)


class ChatRequest(_Sampling):
    messages: Annotated[
        list[Annotated[Message, BeforeValidator(rules.message)]], WrapValidator(rules.messages)
    ] = Field(None, validate_default=True)
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra: the reply prepended with the last message when their roles match
    echo: StrictBool | None = None

    @model_validator(mode="after")
    def _together(self) -> ChatRequest:
        if self.top_logprobs is not None and self.logprobs is not True:
            raise rules.refuse(" needs 'logprobs': true", param="top_logprobs")
        self._check_together()
        return self


class CompletionRequest(_Sampling):
    prompt: Annotated[Any, WrapValidator(rules.prompt)] = Field(None, validate_default=True)
    logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None

    @model_validator(mode="after")
    def _together(self) -> CompletionRequest:
        self._check_together()
        return self


Request = ChatRequest | CompletionRequest
# The model classes that are a union's branch, whose names pydantic puts into an error's
# location (`tool_choice.ToolChoice.type`).
_LABELS = frozenset({"ToolChoice"})


def validate(body: dict[str, Any], chat: bool, max_messages: int) -> Request:
    """The body as the model kvgate reads, or BadRequest naming the field that is not what the
    OpenAI API (or kvgate) allows; a body too deep to forward is refused too."""
    model: type[ChatRequest] | type[CompletionRequest] = ChatRequest if chat else CompletionRequest
    try:
        request = model.model_validate(body, context={"max_messages": max_messages})
    except ValidationError as exc:
        refusal, late = _refusal(exc)
        if late:
            check_encodable(body)
        raise refusal from None
    check_encodable(body)
    return request


def _refusal(exc: ValidationError) -> tuple[BadRequest, bool]:
    """The one refusal to answer, and whether it comes after the encodability check: kvgate's
    own first (in the order `rules.FIRST` reads them), then the field that says most."""
    errors = exc.errors(include_url=False, include_input=False)
    own = [e for e in errors if e["type"] == rules.KVGATE]
    if own:
        error = min(own, key=lambda e: rules.rank(e["loc"]))
        param = error["ctx"].get("param") or error_path(error["loc"], _LABELS)
        refusal = BadRequest(
            f"'{param}{error['ctx']['suffix']}'{error['ctx']['text']}",
            param=param, code=error["ctx"].get("code"),
        )
        return refusal, bool(error["ctx"].get("late"))
    # within a union, the branch that got furthest says most: ["a", 5] is a list of
    # strings with a bad second item, not a bad string
    error = max(errors, key=lambda e: len(error_path(e["loc"], _LABELS)))
    param = error_path(error["loc"], _LABELS)
    return BadRequest(f"'{param}': {_lower_first(str(error['msg']))}", param=param), False


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


def _encodable(value: Any) -> bool:
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True


def _lower_first(message: str) -> str:
    return message[:1].lower() + message[1:]
