"""The normalization pipeline: the rules in order, and `normalize`, which runs the ones a
request's settings switch on.

    normalize(parsed, settings) -> Normalized(request, tally)

Pure: the client's body is never modified; a rule that changes something copies only the
path down to what it changed. When no rule changes anything, the very same `ParsedRequest`
comes back, and the client's bytes go upstream as they would have without normalization.

Which texts the text rules read: the content of system, developer, user and assistant
messages (a string, or the `text` of each text part) and a completions prompt (a string or
each string of a batch). Never touched: tool messages (a tool's output is data), tool calls,
names, non-text parts (images, audio, files) and prompts given as token ids.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvgate.normalize.config import RuleName
from kvgate.normalize.edits import Body, Tally, changed_bytes
from kvgate.normalize.relocate import Pattern, relocate_dynamic
from kvgate.normalize.structure import canonical_json, merge_system, system_first
from kvgate.normalize.text import (
    invisible_characters,
    line_endings,
    trailing_whitespace,
    unicode_nfc,
)
from kvgate.request.parsed import Endpoint, ParsedRequest

TextRule = Callable[[str, bool], str]
BodyRule = Callable[[Body, "Context"], Body]


@dataclass(frozen=True, slots=True)
class Rule:
    name: RuleName
    text: TextRule | None = None  # applied to every text the pipeline reads
    body: BodyRule | None = None  # applied to the whole body


# The order matters: no rule makes work for one before it, so normalizing twice changes
# nothing the first pass did not (invisible characters could hide a trailing blank; the
# structural rules and the relocation only move or join texts that are already clean).
# Text rules come first and run in one walk over the texts.
RULES: tuple[Rule, ...] = (
    Rule("invisible_characters", text=invisible_characters),
    Rule("line_endings", text=line_endings),
    Rule("unicode_nfc", text=unicode_nfc),
    Rule("trailing_whitespace", text=trailing_whitespace),
    Rule("canonical_json", body=canonical_json),
    Rule("system_first", body=system_first),
    Rule("merge_system", body=merge_system),
    Rule("relocate_dynamic", body=relocate_dynamic),
)
# (what was checked: rule names or patterns, whether code blocks were kept, the text)
CleanKey = tuple[tuple[str, ...], bool, str]
TEXT_ROLES = frozenset({"system", "developer", "user", "assistant"})


@dataclass(frozen=True, slots=True)
class Settings:
    """What runs for one model and tenant (`kvgate.normalize.stage` resolves the config to
    this); build with `Settings.of`."""

    text_rules: tuple[Rule, ...]
    body_rules: tuple[Rule, ...]
    keep_code: bool = True
    patterns: tuple[Pattern, ...] = ()
    target: str = "last_user"

    @classmethod
    def of(cls, rules: Iterable[str], *, keep_code: bool = True,
           patterns: tuple[Pattern, ...] = (), target: str = "last_user") -> Settings:  # fmt: skip
        names = set(rules)
        unknown = names - {r.name for r in RULES}
        if unknown:
            raise ValueError(f"unknown rules: {sorted(unknown)}")
        return cls(
            tuple(r for r in RULES if r.text is not None and r.name in names),
            tuple(r for r in RULES if r.body is not None and r.name in names),
            keep_code, patterns, target,
        )

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(r.name for r in (*self.text_rules, *self.body_rules))


@dataclass(frozen=True, slots=True)
class Context:
    """What a body rule is given besides the body: the settings, the tally to fill in, and the
    cache of texts known to need nothing (None: no cache)."""

    settings: Settings
    tally: Tally
    clean: CleanTexts | None = None


@dataclass(frozen=True, slots=True)
class Normalized:
    request: ParsedRequest  # the same object as given when nothing changed
    tally: Tally

    @property
    def changed(self) -> bool:
        return bool(self.tally.edits)


class CleanTexts:
    """Texts the text rules are known to leave as they are, per set of rules: a system prompt
    repeats on every request, and looking it up costs one hash of it. Bounded; only texts
    between `min_chars` and `max_chars` long (a short text is cheaper to check again)."""

    def __init__(self, size: int = 512, min_chars: int = 128, max_chars: int = 32_768) -> None:
        self._texts: OrderedDict[CleanKey, None] = OrderedDict()
        self.size, self.min_chars, self.max_chars = size, min_chars, max_chars

    def cacheable(self, text: str) -> bool:
        return self.min_chars <= len(text) <= self.max_chars

    def __contains__(self, key: CleanKey) -> bool:
        return key in self._texts

    def add(self, key: CleanKey) -> None:
        self._texts[key] = None
        if len(self._texts) > self.size:
            self._texts.popitem(last=False)


def normalize(parsed: ParsedRequest, settings: Settings, clean: CleanTexts | None = None
              ) -> Normalized:  # fmt: skip
    tally = Tally()
    body = parsed.body
    walk = None
    if settings.text_rules:
        walk = _TextWalk(settings.text_rules, settings.keep_code, tally, clean)
        body = walk.body(body, parsed.endpoint)
    context = Context(settings, tally, clean)
    texts_cleaned = body
    for rule in settings.body_rules:
        assert rule.body is not None
        body = rule.body(body, context)
    if walk is not None and body is not texts_cleaned:
        # a body rule joined or moved texts (two system messages merged: an open code fence
        # in the first one changes what is code in the second): the text rules see the texts
        # as they will be sent, so that normalizing again changes nothing
        body = walk.body(body, parsed.endpoint)
    if body is parsed.body:
        return Normalized(parsed, tally)
    return Normalized(dataclasses.replace(parsed, body=body), tally)


class _TextWalk:
    """Every text rule over every text the pipeline reads, copying only what changes."""

    def __init__(self, rules: tuple[Rule, ...], keep_code: bool, tally: Tally,
                 clean: CleanTexts | None) -> None:  # fmt: skip
        self.rules = [(r.name, r.text) for r in rules if r.text is not None]
        self.keep_code, self.tally, self.clean = keep_code, tally, clean
        self.signature = tuple(name for name, _ in self.rules)

    def body(self, body: Body, endpoint: Endpoint) -> Body:
        if endpoint is Endpoint.CHAT:
            messages = body.get("messages")
            new = self.messages(messages) if isinstance(messages, list) else messages
            return body if new is messages else {**body, "messages": new}
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            new_prompt: Any = self.text(prompt)
        elif isinstance(prompt, list) and any(isinstance(p, str) for p in prompt):
            texts = [self.text(p) if isinstance(p, str) else p for p in prompt]
            unchanged = all(a is b for a, b in zip(texts, prompt, strict=True))
            new_prompt = prompt if unchanged else texts
        else:
            return body
        return body if new_prompt is prompt else {**body, "prompt": new_prompt}

    def messages(self, messages: list[Any]) -> list[Any]:
        out: list[Any] | None = None
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in TEXT_ROLES:
                continue
            content = message.get("content")
            if isinstance(content, str):
                new: Any = self.text(content)
            elif isinstance(content, list):
                new = self.parts(content)
            else:
                continue
            if new is not content:
                out = out or list(messages)
                out[index] = {**message, "content": new}
        return messages if out is None else out

    def parts(self, parts: list[Any]) -> list[Any]:
        out: list[Any] | None = None
        for index, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != "text":
                continue
            text = part.get("text")
            if isinstance(text, str) and (new := self.text(text)) is not text:
                out = out or list(parts)
                out[index] = {**part, "text": new}
        return parts if out is None else out

    def text(self, text: str) -> str:
        clean = self.clean
        key = None
        if clean is not None and clean.cacheable(text):
            key = (self.signature, self.keep_code, text)
            if key in clean:
                return text
        out = text
        for name, rule in self.rules:
            new = rule(out, self.keep_code)
            if new is not out:
                self.tally.add(name, 1, changed_bytes(out, new))
                out = new
        if key is not None and out is text:
            assert clean is not None
            clean.add(key)
        return out
