"""A varied, seeded set of prompts: prose, code, CJK, emoji, multi-message chats, tools, and
completions with one or several prompts — the shapes on which token estimates go wrong."""

from __future__ import annotations

import random
from typing import Any

PROSE = (
    "The quick brown fox jumps over the lazy dog while the scheduler admits the next batch. "
    "Operators read the dashboard, see twenty-six percent, and wonder why nothing fits. "
)
CODE = (
    "def worst_case(prompt: int, max_tokens: int, block: int = 16) -> int:\n"
    "    return -(-(prompt + max_tokens) // block)\n\n"
    "for i in range(10):\n    print(i, worst_case(i * 100, 512))\n"
)
CJK = "東京の天気は晴れです。明日は雨が降るでしょう。我们今天讨论键值缓存的分配策略。"
EMOJI = "🚀🔥 done ✅ — cache hit 🎯, preempted 😬, retry ⏳ 🙏🏽👩‍💻"
STYLES = (PROSE, CODE, CJK, EMOJI)
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city, today or tomorrow.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "day": {"type": "string", "enum": ["today", "tomorrow"]},
        }, "required": ["city"]},
    }},
]


def text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(STYLES)[: rng.randint(3, 200)] for _ in range(pieces)).strip() or "hi"


def chat(rng: random.Random, i: int) -> dict[str, Any]:
    turns = rng.choice((1, 1, 2, 3, 5, 8, 12))
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        messages.append({"role": "system", "content": text(rng, rng.randint(1, 6))})
    for turn in range(turns):
        role = "user" if turn % 2 == 0 else "assistant"
        content = text(rng, rng.randint(1, 4)) if rng.random() < 0.8 else rng.choice(("ok", "hi", "?"))
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": f"question {i}"})
    body: dict[str, Any] = {"model": "sim-model", "messages": messages, "max_tokens": 4}
    if rng.random() < 0.2:
        body["tools"] = TOOLS
    return body


def completion(rng: random.Random, i: int) -> dict[str, Any]:
    if rng.random() < 0.3:
        prompt: Any = [text(rng, rng.randint(1, 3)) for _ in range(rng.randint(2, 4))]
    else:
        prompt = text(rng, rng.randint(1, 8))
    return {"model": "sim-model", "prompt": prompt, "max_tokens": 4}
