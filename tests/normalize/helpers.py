"""Request builders for the normalizer's tests."""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.normalize.pipeline import Normalized, Settings, normalize
from kvgate.request.parsed import Endpoint, ParsedRequest, parse_body

SAFE = ("invisible_characters", "line_endings", "unicode_nfc", "trailing_whitespace",
        "canonical_json")


def chat(*messages: dict[str, Any], **fields: Any) -> ParsedRequest:
    body = {"model": "m", "messages": list(messages), **fields}
    return parse_body(orjson.dumps(body), Endpoint.CHAT)


def completion(prompt: Any) -> ParsedRequest:
    return parse_body(orjson.dumps({"model": "m", "prompt": prompt}), Endpoint.COMPLETIONS)


def run(parsed: ParsedRequest, *rules: str, **settings: Any) -> Normalized:
    return normalize(parsed, Settings.of(rules or SAFE, **settings))


def system(content: Any) -> dict[str, Any]:
    return {"role": "system", "content": content}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}
