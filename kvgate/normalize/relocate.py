"""Dynamic content out of the system prompt (opt-in): a timestamp, a date, a request id or a
user's name in the system prompt changes it on every request, and vLLM reuses KV blocks only
up to the first differing token.

Each value a configured pattern finds in the leading system messages is replaced there by a
constant placeholder — `[timestamp]` — and listed, in order, in one short note at the end of
the prompt, so the long static part stays byte-identical and the model still reads the value:

    system: "Now: [timestamp]. You are the support assistant of ..."
    user:   "How do refunds work?\\n\\n[moved from the system prompt] timestamp: 2026-11-29T10:00Z"

The note goes at the end of the last user message (target `last_user`), or in a final system
message (`system_note`, also used when there is no user message). What it may change: the
model reads the value later than it was written, next to the question; and in a multi-turn
chat the previous turn carried its note in a message that the next turn sends without it, so
that turn's answer is recomputed rather than reused (the system prompt, the long part, is).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from kvgate.normalize.config import NamedPattern, RelocationConfig
from kvgate.normalize.edits import Body
from kvgate.normalize.structure import NOTE_MARK, is_note

if TYPE_CHECKING:
    from kvgate.normalize.pipeline import CleanTexts, Context

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
BUILTIN: dict[str, str] = {
    # ISO 8601 date and time, to the minute at least: 2026-11-29T10:00Z, 2026-11-29 10:00:05+01:00
    "timestamp": (
        r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z\b|[+-]\d{2}:?\d{2}\b)?"
    ),
    # 2026-11-29, November 29, 2026, Nov 29th 2026, 29 November 2026
    "date": (
        rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b{_MONTH} \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}\b"
        rf"|\b\d{{1,2}} {_MONTH} \d{{4}}\b"
    ),
    # a UUID, or the value after "request id:", "trace-id=" and the like
    "request_id": (
        r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
        r"|(?i:\b(?:request|trace|correlation)[ _-]?id\s*[:=#]\s*)(?P<value>[A-Za-z0-9._-]{4,})"
    ),
    # a capitalised name after "User:", "The user's name is", "You are talking to", ...
    "user_name": (
        r"(?i:\b(?:user(?:'s)? name is|user name:|user:|customer:|customer name:|the user is"
        r"|you are (?:talking|speaking|chatting) (?:to|with)))\s+"
        r"(?P<value>[A-Z][\w'-]*(?: [A-Z][\w'-]*){0,2})"
    ),
}
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class Pattern:
    name: str
    regex: re.Pattern[str]


def compile_patterns(config: RelocationConfig) -> tuple[Pattern, ...]:
    """The configured patterns, timestamps before dates (a date pattern would otherwise take
    the date out of a timestamp and leave its time behind)."""
    patterns = []
    for entry in config.patterns:
        if isinstance(entry, NamedPattern):
            patterns.append(Pattern(entry.name, re.compile(entry.regex)))
        else:
            patterns.append(Pattern(entry, re.compile(BUILTIN[entry])))
    order = {"timestamp": 0, "date": 1}
    return tuple(sorted(patterns, key=lambda p: order.get(p.name, 0)))


def relocate_dynamic(body: Body, context: Context) -> Body:
    settings, tally = context.settings, context.tally
    messages = body.get("messages")
    if not isinstance(messages, list) or not settings.patterns:
        return body
    finder = _Finder(settings.patterns, context.clean)
    moved = finder.moved
    new_messages: list[Any] | None = None
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in SYSTEM_ROLES:
            break  # only the leading system messages: the prefix every request shares
        if is_note(message):
            continue
        content = message.get("content")
        new_content = finder.content(content)
        if new_content is not content:
            new_messages = new_messages or list(messages)
            new_messages[index] = {**message, "content": new_content}
    if new_messages is None:
        return body
    values: dict[tuple[str, str], None] = dict.fromkeys(moved)  # in order, once each
    note = NOTE_MARK + " " + "; ".join(f"{name}: {value}" for name, value in values)
    for name, _ in moved:
        tally.moved[name] += 1
    tally.add("relocate_dynamic", len(moved), 2 * sum(len(v.encode()) for _, v in moved))
    return {**body, "messages": _with_note(new_messages, note, settings.target)}


class _Finder:
    """Finds and replaces the patterns' values in texts; remembers the texts with none."""

    def __init__(self, patterns: tuple[Pattern, ...], clean: CleanTexts | None) -> None:
        self.patterns, self.clean = patterns, clean
        self.signature = tuple(p.name for p in patterns)
        self.moved: list[tuple[str, str]] = []

    def content(self, content: Any) -> Any:
        if isinstance(content, str):
            return self.text(content)
        if not isinstance(content, list):
            return content
        parts: list[Any] | None = None
        for index, part in enumerate(content):
            if (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                text = self.text(part["text"])
                if text is not part["text"]:
                    parts = parts or list(content)
                    parts[index] = {**part, "text": text}
        return content if parts is None else parts

    def text(self, text: str) -> str:
        clean = self.clean
        key = None
        if clean is not None and clean.cacheable(text):
            key = (self.signature, False, text)
            if key in clean:
                return text
        out = text
        for pattern in self.patterns:
            if pattern.regex.search(out) is not None:
                out = pattern.regex.sub(partial(self._replace, name=pattern.name), out)
        if out == text:
            if key is not None and clean is not None:
                clean.add(key)
            return text
        return out

    def _replace(self, match: re.Match[str], *, name: str) -> str:
        group: int | str = 0
        if "value" in match.re.groupindex and match.group("value"):
            group = "value"
        value = match.group(group).strip()
        if not value:
            return match.group(0)
        self.moved.append((name, value))
        start, end = match.span(group)
        whole, offset = match.group(0), match.start()
        return whole[: start - offset] + f"[{name}]" + whole[end - offset:]


def _with_note(messages: list[Any], note: str, target: str) -> list[Any]:
    if target == "last_user":
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            if not isinstance(message, dict) or message.get("role") != "user":
                continue
            content = message.get("content")
            if isinstance(content, str):
                messages[index] = {**message, "content": f"{content}\n\n{note}"}
                return messages
            if isinstance(content, list):
                part = {"type": "text", "text": note}
                messages[index] = {**message, "content": [*content, part]}
                return messages
            break
    messages.append({"role": "system", "content": note})
    return messages
