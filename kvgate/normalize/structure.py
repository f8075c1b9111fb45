"""Body rules that edit structure: canonical JSON of tool definitions and schemas (safe), and
the opt-in system-message rules. Each is a plain `(body, context) -> body` function
that returns the body itself when it has nothing to change, and otherwise a new body that
shares every part it did not change (the client's body is never modified in place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from kvgate.normalize.edits import Body, Tally, changed_bytes

if TYPE_CHECKING:
    from kvgate.normalize.pipeline import Context

NOTE_MARK = "[moved from the system prompt]"


def canonical_json(body: Body, context: Context) -> Body:
    """`tools`, `functions` and `response_format` with their keys in a stable (sorted) order.
    Insignificant whitespace is gone already: kvgate forwards the parsed body re-encoded
    compactly. In `response_format` the order of a schema's `properties` is kept: guided
    decoding writes an object's fields in that order, which is meaning, not noise."""
    out, tally = body, context.tally
    for field in ("tools", "functions"):
        value = body.get(field)
        if isinstance(value, list) and value:
            out = _canonical_list(out, field, value, tally)
    value = body.get("response_format")
    before = _dumps(value) if isinstance(value, dict) else None
    if before is not None:  # (None: nested deeper than JSON encoders go; the counter says so)
        canonical = _sorted(value, keep_properties=True)
        after = orjson.dumps(canonical)
        if before != after:
            tally.add("canonical_json", 1, changed_bytes(before.decode(), after.decode()))
            out = {**out, "response_format": canonical}
    return out


def _canonical_list(body: Body, field: str, value: list[Any], tally: Tally) -> Body:
    try:
        if orjson.dumps(value) == orjson.dumps(value, option=orjson.OPT_SORT_KEYS):
            return body
    except orjson.JSONEncodeError:  # nested too deep: the counter answers the client's 400
        return body
    items = []
    for item in value:
        canonical = _sorted(item, keep_properties=False)
        before, after = orjson.dumps(item).decode(), orjson.dumps(canonical).decode()
        if before != after:
            tally.add("canonical_json", 1, changed_bytes(before, after))
        items.append(canonical)
    return {**body, field: items}


def _sorted(value: Any, *, keep_properties: bool) -> Any:
    if isinstance(value, dict):
        return {
            key: (
                {k: _sorted(v, keep_properties=True) for k, v in value[key].items()}
                if keep_properties and key == "properties" and isinstance(value[key], dict)
                else _sorted(value[key], keep_properties=keep_properties)
            )
            for key in sorted(value)
        }
    if isinstance(value, list):
        return [_sorted(v, keep_properties=keep_properties) for v in value]
    return value


def _dumps(value: Any) -> bytes | None:
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return None


def is_note(message: Any) -> bool:
    """A note the relocation rule wrote: the structural rules leave it where it is."""
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, str) and content.startswith(NOTE_MARK)


def _movable_system(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "system" and not is_note(message)


def system_first(body: Body, context: Context) -> Body:
    """System messages moved to the front, in their order; the others keep theirs. (A system
    message sent mid-conversation then reads as if it had been there from the start.)"""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    systems = [m for m in messages if _movable_system(m)]
    if all(_movable_system(m) for m in messages[: len(systems)]):
        return body
    moved = sum(1 for m in messages[len(systems):] if _movable_system(m))
    others = [m for m in messages if not _movable_system(m)]
    context.tally.add("system_first", moved, sum(len(_text(m).encode()) for m in systems))
    return {**body, "messages": systems + others}


def merge_system(body: Body, context: Context) -> Body:
    """Consecutive system messages joined into one, their texts separated by a blank line.
    Only messages with nothing but a role and text content are merged."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    out: list[Any] = []
    merged = 0
    for message in messages:
        previous = out[-1] if out else None
        if _mergeable(message) and previous is not None and _mergeable(previous):
            # an empty text adds no blank line: the result must be as clean as its parts
            text = "\n\n".join(t for t in (_text(previous), _text(message)) if t)
            out[-1] = {"role": "system", "content": text}
            merged += 1
            context.tally.add("merge_system", 1, len(_text(message).encode()) + 2)
        else:
            out.append(message)
    return {**body, "messages": out} if merged else body


def _mergeable(message: Any) -> bool:
    if not _movable_system(message) or set(message) - {"role", "content"}:
        return False
    content = message.get("content")
    return isinstance(content, str) or (
        isinstance(content, list)
        and all(isinstance(p, dict) and p.get("type") == "text"
                and isinstance(p.get("text"), str) and set(p) == {"type", "text"}
                for p in content)
    )


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # empty parts dropped: they would only add blank lines
        return "\n".join(p["text"] for p in content if isinstance(p, dict)
                         and isinstance(p.get("text"), str) and p["text"])
    return ""
