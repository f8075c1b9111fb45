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

from kvgate.request.tokenizers import TokenizerError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A compiled chat template and the special tokens its config names."""

    source: str
    special_tokens: Mapping[str, str]
    _render: Callable[..., str]
    # How vLLM hands this template a message's content (`content_format`): "string", or
    # "openai" (a list of typed parts).
    content_format: str = "string"

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
            messages=as_vllm_renders(messages, self.content_format), tools=tools,
            add_generation_prompt=add_generation_prompt,
        )
        return self._render(**context)


def as_vllm_renders(
    messages: Sequence[Mapping[str, Any]], content_format: str = "string"
) -> list[Mapping[str, Any]]:
    """The messages as vLLM hands them to the template. Their content in the template's
    format: for a "string" template, its non-empty text parts joined by newlines; for an "openai"
    one, a string as one text part. An assistant's tool calls carry their `arguments` as an
    object, parsed from the JSON string the OpenAI API sends (not valid JSON, not an object,
    or empty: `{}`), and an empty `tool_calls` list is dropped. The request's own messages
    are left as they are; only those that change are copied. Found on a real vLLM (0.32's
    `_postprocess_messages`): without it every chat with a tool call in its history was
    over-counted by the JSON string's quoting."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        content = _content_as(message.get("content"), content_format)
        calls = message.get("tool_calls")
        calls_change = message.get("role") == "assistant" and isinstance(calls, list)
        if content is message.get("content") and not calls_change:
            out.append(message)
            continue
        copy = dict(message)
        copy["content"] = content
        if calls_change and not calls:
            del copy["tool_calls"]
        elif calls_change:
            copy["tool_calls"] = [_with_parsed_arguments(call) for call in calls or ()]
        out.append(copy)
    return out


def _content_as(content: Any, content_format: str) -> Any:
    """A message's content as vLLM renders it for a template of this format (the same
    object when nothing changes): no content is no parts, so an empty string or list."""
    if content is None:
        return [] if content_format == "openai" else ""
    if content_format == "openai" and isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content_format == "string" and isinstance(content, list):
        texts = [part.get("text") for part in content
                 if isinstance(part, dict) and part.get("type") == "text"]
        return "\n".join(t for t in texts if isinstance(t, str) and t)  # vLLM skips empty ones
    return content


def content_format(source: str) -> str:
    """"openai" if the template loops over a message's content (so vLLM hands it typed parts),
    else "string" (vLLM joins the text parts). vLLM decides the same way, from the template's
    syntax tree: a `for` over `<message>['content']` (or `.content`, filtered or sliced, or a
    variable set from it), where `<message>` is the variable of a loop over `messages` (or over
    a variable set from it). Content handed to a macro is not followed."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.exceptions.TemplateError:
        return "string"

    def unwrap(node: nodes.Node) -> nodes.Node:
        """Through filters, tests and slices to what they read."""
        while isinstance(node, nodes.Filter | nodes.Test) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        ):
            node = node.node  # type: ignore[assignment]
        return node

    def named(node: nodes.Node, names: set[str]) -> bool:
        node = unwrap(node)
        return isinstance(node, nodes.Name) and node.name in names

    def aliases(names: set[str], also: Callable[[nodes.Node], bool] = lambda n: False) -> set[str]:
        """`names` and every variable `set` from one of them (or from what `also` accepts)."""
        found, grew = set(names), True
        while grew:
            grew = False
            for assign in tree.find_all(nodes.Assign):
                target = assign.target
                if isinstance(target, nodes.Name) and target.name not in found and (
                        named(assign.node, found) or also(assign.node)):
                    found.add(target.name)
                    grew = True
        return found

    lists = aliases({"messages"})
    loops = {loop.target.name for loop in tree.find_all(nodes.For)
             if isinstance(loop.target, nodes.Name) and named(loop.iter, lists)}

    def content_of_a_message(node: nodes.Node) -> bool:
        node = unwrap(node)
        if isinstance(node, nodes.Getattr):
            return named(node.node, loops) and node.attr == "content"
        if isinstance(node, nodes.Getitem):
            return (named(node.node, loops) and isinstance(node.arg, nodes.Const)
                    and node.arg.value == "content")
        return False

    contents = aliases(set(), also=content_of_a_message)
    for loop in tree.find_all(nodes.For):
        if content_of_a_message(loop.iter) or named(loop.iter, contents):
            return "openai"
    return "string"


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
    return ChatTemplate(source, dict(special_tokens or {}), template.render,
                        content_format(source))


def load_template(path: Path, tokenizer_file: Path | None = None) -> ChatTemplate:
    """From a `tokenizer_config.json` (its `chat_template`, a string or the list of named
    templates HF allows, of which "default" is used) or from a plain `.jinja` file. A `.jinja`
    file takes its special tokens (`bos_token`, `eos_token`, ...) from the
    `tokenizer_config.json` beside `tokenizer_file`, as vLLM's `--chat-template` does from the
    model's tokenizer: without them `{{ bos_token }}` renders empty and every count is short."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenizerError(f"cannot read chat template {path}: {exc.strerror or exc}") from None
    if path.suffix != ".json":
        return compile_template(text, _special_tokens(_beside(tokenizer_file)))
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


def _beside(tokenizer_file: Path | None) -> dict[str, Any]:
    """The `tokenizer_config.json` beside a tokenizer file, or nothing."""
    if tokenizer_file is None:
        return {}
    try:
        config = json.loads((tokenizer_file.parent / "tokenizer_config.json").read_text("utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


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
