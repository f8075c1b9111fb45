"""The bodies vLLM's OpenAI-compatible server sends: full responses and SSE chunks.

Streamed token chunks are the hot path of the simulator, so a plain choice (filler text, no
logprobs, no tool call, no JSON) pre-renders the bytes around a chunk's text once; a token
chunk is then three byte strings joined, the middle one the pre-encoded JSON of a filler
word. Choices with more to say are rendered from dicts by `kvgate.sim.extras.RichChunks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from kvgate.sim.text import FILLER_WORDS

WORD_JSON: tuple[bytes, ...] = tuple(orjson.dumps(word) for word in FILLER_WORDS)
DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    )


def chat_choice(
    index: int,
    finish_reason: str,
    content: str | None,
    *,
    tool_calls: Sequence[dict[str, Any]] = (),
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": list(tool_calls),
            "reasoning_content": None,
        },
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }


def text_choice(
    index: int, text: str, finish_reason: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "prompt_logprobs": None,
    }


@dataclass(frozen=True, slots=True)
class Completion:
    """Identity of one response: chat (`chat.completion`) or text (`text_completion`)."""

    chat: bool
    response_id: str
    created: int
    model: str

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def full(
        self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage(prompt_tokens, completion_tokens),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }

    def chunk(self, choice: dict[str, Any]) -> bytes:
        """One SSE event carrying one choice's delta."""
        body = {
            "id": self.response_id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"


class ChoiceChunks(Protocol):
    """One choice's SSE events, asked for in order by the stream loop.

    `opening` is called once, before any token; `tokens(start, end, finish_reason)` returns
    one event per output token start .. end-1 (end > start), the last carrying the finish
    reason when one is given. Successive calls continue where the previous one ended.
    """

    def opening(self) -> list[bytes]: ...

    def tokens(self, start: int, end: int, finish_reason: str | None) -> bytes: ...


class ChunkWriter:
    """A plain choice's SSE events, from bytes pre-rendered once per choice."""

    __slots__ = ("_finish_close", "_head", "_open", "_plain_close", "chat")

    def __init__(self, completion: Completion, index: int = 0) -> None:
        self.chat = chat = completion.chat
        obj = completion.chunk_object.encode()
        self._head = (
            b'data: {"id":' + orjson.dumps(completion.response_id)
            + b',"object":"' + obj
            + b'","created":' + str(completion.created).encode()
            + b',"model":' + orjson.dumps(completion.model)
            + b',"choices":[{"index":' + str(index).encode() + b","
        )  # fmt: skip
        self._open = self._head + (b'"delta":{"content":' if chat else b'"text":')
        close = b"}" if chat else b""
        self._plain_close = close + (
            b',"logprobs":null,"finish_reason":null}]}\n\n'
            if chat
            else b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        )
        self._finish_close = close + b',"logprobs":null,"finish_reason":"'

    def opening(self) -> list[bytes]:
        """Chat's first chunk: the assistant role and empty content (none for completions)."""
        if not self.chat:
            return []
        return [
            self._head
            + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
            + b"\n\n"
        ]

    def tokens(self, start: int, end: int, finish_reason: str | None) -> bytes:
        n = len(WORD_JSON)
        opening, close = self._open, self._plain_close
        parts = [opening + WORD_JSON[i % n] + close for i in range(start, end)]
        if finish_reason is not None and parts:
            parts[-1] = (
                opening
                + WORD_JSON[(end - 1) % n]
                + self._finish_close
                + finish_reason.encode()
                + b'","stop_reason":null}]}\n\n'
            )
        return b"".join(parts)
