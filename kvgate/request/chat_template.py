"""A model's own chat template, rendered the way `transformers` renders it, to count exactly.

vLLM turns chat messages into a prompt with the Jinja template in the model's
`tokenizer_config.json` (`chat_template`), through `transformers.apply_chat_template`, and
tokenizes the result without adding special tokens again. kvgate does the same with Jinja2
directly — a sandboxed environment with `trim_blocks` and `lstrip_blocks`, the loop-controls
extension, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII as it is —
so that with the model's tokenizer the count is the count vLLM will report.

The template sees `messages`, `tools`, `add_generation_prompt`, the special tokens named in
the config (`bos_token`, `eos_token`, …) and any `chat_template_kwargs` the request carries,
as vLLM passes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvgate.request.tokens import TokenizerError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A compiled chat template and the special tokens its config names."""

    source: str
    special_tokens: Mapping[str, str]
    _render: Callable[..., str]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Any = None,
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        context: dict[str, Any] = {**self.special_tokens, **(extra or {})}
        context.update(
            messages=as_vllm_renders(messages), tools=tools,
            add_generation_prompt=add_generation_prompt,
        )
        return self._render(**context)


def as_vllm_renders(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The messages as vLLM hands them to the template: an assistant's tool calls carry their
    `arguments` as an object, parsed from the JSON string the OpenAI API sends (not valid
    JSON, not an object, or empty: `{}`), and an empty `tool_calls` list is dropped. The
    request's own messages are left as they are; only those that change are copied.
    Found on a real vLLM (0.32's `_postprocess_messages`): without it every chat with a
    tool call in its history was over-counted by the JSON string's quoting."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list):
            out.append(message)
            continue
        copy = dict(message)
        if not calls:
            del copy["tool_calls"]
        else:
            copy["tool_calls"] = [_with_parsed_arguments(call) for call in calls]
        out.append(copy)
    return out


def _with_parsed_arguments(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call  # vLLM refuses such a call itself
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}


def compile_template(source: str, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"the chat template does not compile: {exc}") from exc
    return ChatTemplate(source, dict(special_tokens or {}), template.render)


def load_template(path: Path) -> ChatTemplate:
    """From a `tokenizer_config.json` (its `chat_template`, a string or the list of named
    templates HF allows, of which "default" is used) or from a plain `.jinja` file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenizerError(f"cannot read chat template {path}: {exc.strerror or exc}") from None
    if path.suffix != ".json":
        return compile_template(text)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from None
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        raise TokenizerError(f"{path} has no chat_template")
    return compile_template(source, _special_tokens(config))


def find_template(tokenizer_file: Path | None) -> Path | None:
    """The `tokenizer_config.json` beside a `tokenizer.json`, if it has a chat template."""
    if tokenizer_file is None:
        return None
    candidate = tokenizer_file.parent / "tokenizer_config.json"
    try:
        config = json.loads(candidate.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return candidate if isinstance(config, dict) and config.get("chat_template") else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out
