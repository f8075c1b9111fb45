"""A seeded chat workload with the noise production clients add to one system prompt — for
the tests, the benchmark and the demo.

Every noisy request carries the same static system prompt and tools, but: the current time in
its first line, CRLF line ends (half the time), random trailing spaces on random lines, and
each tool definition with its keys in a random order. `clean_chats` sends the same prompts
as a careful client would: no timestamp, LF, no trailing blanks, keys in sorted order — the
hit rate normalization is measured against.
"""

from __future__ import annotations

import random
from typing import Any

SYSTEM_LINES = [
    "You are the support assistant of Example Corp.",
    "Answer in at most three sentences, in the customer's language.",
    "Policies:",
    "- Be precise; cite the relevant article of the handbook by its number.",
    "- Never invent facts, prices or delivery dates.",
    "- If unsure, say so and point to the help centre at help.example.com.",
    "- Refunds: within 30 days of delivery, for unused items, to the original payment method.",
    "- Shipping: standard 3-5 working days, express next working day if ordered before noon.",
    "- Accounts: never ask for a password; send the reset link instead.",
    "- Invoices: available as PDF under Orders; corrections need the order number.",
    "- Escalate to a human agent when the customer asks twice or mentions a legal matter.",
    "Tone: friendly, direct, no marketing language.",
    "Format: plain text; lists only when the customer asks for steps.",
] * 3  # about 600 tokens

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "description": "The order number."},
                    "reason": {"type": "string", "description": "Why, in the customer's words."},
                },
                "required": ["order_id"],
            },
        },
    }
    for name, description in [
        ("lookup_order", "Find an order and its status."),
        ("refund_order", "Start a refund for an order."),
        ("escalate", "Hand the conversation to a human agent."),
    ]
]
QUESTIONS = ["Where is my order {n}?", "Can I get a refund for order {n}?",
             "How do I reset my password? (ticket {n})", "Please correct invoice {n}."]


def noisy_chats(n: int, seed: int = 0, model: str = "sim-model") -> list[dict[str, Any]]:
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        lines = [line + " " * rng.choice((0, 0, 1, 2)) for line in SYSTEM_LINES]
        stamp = f"Current time: 2026-11-29T{rng.randint(0, 23):02}:{rng.randint(0, 59):02}:" \
                f"{rng.randint(0, 59):02}Z"  # fmt: skip
        newline = "\r\n" if rng.random() < 0.5 else "\n"
        system = newline.join([stamp, *lines]) + " " * rng.randint(0, 2)
        tools = [_shuffled(tool, rng) for tool in TOOLS]
        bodies.append(_body(model, system, tools, i))
    return bodies


def clean_chats(n: int, seed: int = 0, model: str = "sim-model") -> list[dict[str, Any]]:
    tools = [_sorted(tool) for tool in TOOLS]
    return [_body(model, "\n".join(SYSTEM_LINES), tools, i) for i in range(n)]


def _body(model: str, system: str, tools: list[Any], i: int) -> dict[str, Any]:
    question = QUESTIONS[i % len(QUESTIONS)].format(n=10_000 + i)
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "tools": tools,
        "max_tokens": 8,
    }


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in a random order (a list keeps its)."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: _shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value
