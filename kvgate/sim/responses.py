"""The bodies vLLM's OpenAI-compatible server sends: full responses and SSE chunks.

Streamed token chunks are the hot path of the simulator, so each request pre-renders the
bytes around a chunk's text once; a token chunk is then three byte strings joined, the
middle one the pre-encoded JSON of a filler word.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.sim.text import FILLER_WORDS, filler_text

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


@dataclass(frozen=True, slots=True)
class Completion:
    """Identity of one response: chat (`chat.completion`) or text (`text_completion`)."""

    chat: bool
    response_id: str
    created: int
    model: str

    def full(
        self, num_tokens: int, finish_reason: str, prompt_tokens: int
    ) -> dict[str, Any]:
        text = filler_text(0, num_tokens)
        choice: dict[str, Any]
        if self.chat:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage(prompt_tokens, num_tokens),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }


class ChunkWriter:
    """Renders one stream's SSE events as bytes."""

    __slots__ = ("_completion", "_finish_close", "_head", "_open", "_plain_close")

    def __init__(self, completion: Completion) -> None:
        self._completion = completion
        chat = completion.chat
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        self._head = (
            b'data: {"id":' + orjson.dumps(completion.response_id)
            + b',"object":"' + obj
            + b'","created":' + str(completion.created).encode()
            + b',"model":' + orjson.dumps(completion.model)
            + b',"choices":[{"index":0,'
        )  # fmt: skip
        self._open = self._head + (b'"delta":{"content":' if chat else b'"text":')
        close = b"}" if chat else b""
        self._plain_close = close + (
            b',"logprobs":null,"finish_reason":null}]}\n\n'
            if chat
            else b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        )
        self._finish_close = close + b',"logprobs":null,"finish_reason":"'

    def role(self) -> bytes:
        """The first chat chunk: the assistant role and empty content."""
        return self._head + (
            b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def tokens(self, start: int, end: int, finish_reason: str | None) -> bytes:
        """Chunks for output tokens start .. end-1; the last carries `finish_reason` if given."""
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

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        c = self._completion
        body: dict[str, Any] = {
            "id": c.response_id,
            "object": "chat.completion.chunk" if c.chat else "text_completion",
            "created": c.created,
            "model": c.model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"
