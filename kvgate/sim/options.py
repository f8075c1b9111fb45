"""What a request asks of its choices beyond plain text, validated as vLLM validates it.

    n, best_of            sequences per prompt (best_of: completions only, >= n, not streamed)
    logprobs              chat: a boolean, with `top_logprobs` 0..20; completions: 0..20
    tool_choice, tools    chat: a named function (or "required": the first tool) is called
    response_format       "text", or "json_object" / "json_schema": the content is JSON

Pure: a request body in, an `OutputOptions` out, or an `OptionError` whose message and param
the server returns as a 400 in vLLM's error shape.

One extension no vLLM has, for replaying production traces in benchmarks: the request header
`X-Sim-Output-Tokens: N` makes the simulated model end its answer after N tokens (its
end-of-sequence), instead of a length drawn from the replica's `output_len_*` distribution.
`max_tokens` still caps it (finish_reason "length") and `ignore_eos` still forces max_tokens;
every sequence of the request (`n`, a prompt list) gets the same N. It is a header, not a
body field, so a gateway in front reads nothing from it that forces a length (as `ignore_eos`
or `min_tokens` would) and passes it on as any other header: kvgate and vllm-router both do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_SEQUENCES = 128
# vLLM's default --max-logprobs; the OpenAI API allows 5 for completions, vLLM up to this.
MAX_LOGPROBS = 20
JSON_FORMATS = ("json_object", "json_schema")
OUTPUT_TOKENS_HEADER = "X-Sim-Output-Tokens"


class OptionError(ValueError):
    """A field has a value vLLM refuses (the server answers 400 naming `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How many sequences to generate per prompt, and how each choice is rendered."""

    n: int = 1
    best_of: int = 1  # sequences generated per prompt; the n most likely are returned
    logprobs: int | None = None  # None: no logprobs; else alternatives listed per token
    tool_name: str | None = None  # the function every choice calls, its arguments generated
    json_content: bool = False  # the text is one JSON object

    @property
    def plain(self) -> bool:
        """Filler text only: the choice can be streamed from pre-rendered bytes."""
        return self.logprobs is None and self.tool_name is None and not self.json_content


def chat_options(body: Mapping[str, Any]) -> OutputOptions:
    n = _count(body, "n")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise OptionError(f"logprobs must be a boolean, got {logprobs!r}.", "logprobs")
    top = _logprob_count(body, "top_logprobs")
    if top and not logprobs:
        raise OptionError(
            "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
        )
    return OutputOptions(
        n=n,
        best_of=n,
        logprobs=(top or 0) if logprobs else None,
        tool_name=_tool_name(body.get("tool_choice"), body.get("tools")),
        json_content=_json_content(body.get("response_format")),
    )


def completion_options(body: Mapping[str, Any]) -> OutputOptions:
    n = _count(body, "n")
    best_of = _count(body, "best_of", default=n)
    if best_of < n:
        raise OptionError(
            f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}.",
            "best_of",
        )
    if best_of > n and body.get("stream"):
        raise OptionError("best_of > n is not supported with stream=true.", "best_of")
    return OutputOptions(
        n=n,
        best_of=best_of,
        logprobs=_logprob_count(body, "logprobs"),
        json_content=_json_content(body.get("response_format")),
    )


def output_tokens(headers: Mapping[str, str]) -> int | None:
    """The answer length the benchmark-only header asks for (None: no header)."""
    value = headers.get(OUTPUT_TOKENS_HEADER)
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise OptionError(f"{OUTPUT_TOKENS_HEADER} must be a positive integer, got {value!r}.")
    return int(value)


def _count(body: Mapping[str, Any], key: str, default: int = 1) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError(f"{key} must be an integer, got {value!r}.", key)
    if not 1 <= value <= MAX_SEQUENCES:
        raise OptionError(f"{key} must be from 1 to {MAX_SEQUENCES}, got {value}.", key)
    return value


def _logprob_count(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError(f"`{key}` must be an integer, got {value!r}.", key)
    if value < 0:
        raise OptionError(f"`{key}` must be a positive value.", key)
    if value > MAX_LOGPROBS:
        raise OptionError(
            f"Requested sample logprobs of {value}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
            key,
        )
    return value


def _tool_names(tools: Any) -> list[str]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise OptionError("tools must be a list of tool objects.", "tools")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str)
        ):
            raise OptionError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}.",
                "tools",
            )
        names.append(function["name"])
    return names


def _tool_name(choice: Any, tools: Any) -> str | None:
    """The function a `tool_choice` forces, or None when the reply is plain content."""
    names = _tool_names(tools)
    if choice is None or choice in ("none", "auto"):
        return None
    if choice == "required":
        if not names:
            raise OptionError("tool_choice 'required' needs at least one tool.", "tool_choice")
        return names[0]
    function = choice.get("function") if isinstance(choice, Mapping) else None
    if (
        not isinstance(choice, Mapping)
        or choice.get("type") != "function"
        or not isinstance(function, Mapping)
        or not isinstance(function.get("name"), str)
    ):
        raise OptionError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}.",
            "tool_choice",
        )
    if not names:
        raise OptionError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if function["name"] not in names:
        raise OptionError(
            f"Tool '{function['name']}' has not been passed in `tools`.", "tool_choice"
        )
    return str(function["name"])


def _json_content(response_format: Any) -> bool:
    if response_format is None:
        return False
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return False
    if kind in JSON_FORMATS:
        return True
    raise OptionError(
        "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
        f"{{'type': 'json_schema', ...}}, got {response_format!r}.",
        "response_format",
    )
