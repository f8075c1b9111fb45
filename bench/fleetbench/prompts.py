"""The text the workloads send: single-token words, the shared system prompts, chat bodies.

Every word is one cl100k token with its leading space (and without it), so a prompt of n
words is n tokens plus its messages' template, as the replicas count it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from kvgate.sim.text import IM_END, IM_START
from kvgate.tools.workload import WorkItem

MODEL = "sim-model"
# kvgate's `models[].tokenizer` for the simulator: its ChatML template, with the markers as
# the single tokens it counts them as, so kvgate knows a chat's token ids exactly (what
# precise prefix routing on the replicas' KV events needs)
SIM_TOKENIZER: dict[str, Any] = {
    "kind": "tiktoken",
    "template_file": str(Path(__file__).resolve().parents[2] / "config" / "sim-chatml.jinja"),
    "special_tokens": {"<|im_start|>": IM_START, "<|im_end|>": IM_END},
}
# Each a single cl100k token with its leading space.
WORDS = (
    "the", "data", "model", "answer", "request", "customer", "order", "invoice", "account",
    "payment", "service", "system", "report", "policy", "product", "team", "support", "time",
    "number", "value", "result", "process", "issue", "update", "change", "user", "access",
    "security", "network", "server", "storage", "cost", "plan", "price", "market", "sales",
    "growth", "review", "risk", "quality", "test", "release", "version", "feature", "error",
    "event", "log", "metric", "alert",
)
ASSISTANT_PROMPT = (
    "You are a helpful assistant for the employees of Example Corp. Be accurate and complete; "
    "use lists where they help; ask a clarifying question when the request is ambiguous. "
) * 6  # 205 tokens: the system prompt of a chat product's every conversation
EXTRACTION_PROMPT = (
    "Extract every order number, amount and date from the text below and return them as a "
    "JSON list of objects with the keys order, amount and date. "
) * 3  # 91 tokens: the instruction of every bulk extraction job


RAG_PROMPT = (
    "You are the analyst of Example Corp's document desk. Answer from the document the user "
    "gives you; say so when it does not say. "
) * 4  # the system prompt every question about a document is asked under


def words(rng: random.Random, count: int) -> str:
    """`count` words drawn from WORDS: `count` tokens."""
    return " ".join(rng.choices(WORDS, k=count))


def chat(at: float, kind: str, tenant: str, system: str | None, questions: list[str],
         answers: list[str], max_tokens: int | None,
         headers: dict[str, str] | None = None) -> WorkItem:  # fmt: skip
    """A chat request: the system prompt (None: none), then each question and the answer to
    it that the client resends; max_tokens None: the body has none."""
    messages: list[dict[str, str]] = [] if system is None else [
        {"role": "system", "content": system}]  # fmt: skip
    for i, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    body: dict[str, object] = {"model": MODEL, "messages": messages}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return WorkItem(at, kind, tenant, body, headers or {})
