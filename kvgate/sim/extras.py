"""Choices with more than filler text: logprobs, a named tool call, JSON content.

The simulated model still samples one filler word per token; these only frame the words.
JSON content and tool-call arguments are one object, `{"text": "..."}` or `{"input": "..."}`,
whose opening rides on the first token's text and whose closing on the last token's, so
`completion_tokens` stays the number of tokens generated and every prefix of a stream
concatenates to the same text a whole response carries.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from kvgate.sim.logprobs import LogprobTable, chat_logprobs, text_logprobs
from kvgate.sim.options import OutputOptions
from kvgate.sim.responses import Completion, chat_choice, text_choice
from kvgate.sim.text import FILLER_WORDS


@dataclass(frozen=True, slots=True)
class Shape:
    """The text of output tokens: filler words, the first after `prefix`, the last before
    `suffix`."""

    prefix: str = ""
    suffix: str = ""

    def pieces(self, start: int, end: int, final: bool) -> list[str]:
        """The texts of tokens start .. end-1; `final`: token end-1 is the choice's last."""
        n = len(FILLER_WORDS)
        pieces = [FILLER_WORDS[i % n] for i in range(start, end)]
        if pieces and start == 0 and self.prefix:
            pieces[0] = self.prefix + pieces[0]
        if pieces and final and self.suffix:
            pieces[-1] += self.suffix
        return pieces


PLAIN = Shape()
JSON_CONTENT = Shape('{"text": "', '"}')
TOOL_ARGUMENTS = Shape('{"input": "', '"}')


def shape_of(options: OutputOptions) -> Shape:
    if options.tool_name is not None:
        return TOOL_ARGUMENTS
    return JSON_CONTENT if options.json_content else PLAIN


def tool_call_id() -> str:
    """vLLM's id for a tool call it parsed: `chatcmpl-tool-` and a random hex uuid."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def finish_reason_of(options: OutputOptions, reason: str) -> str:
    """A forced tool call ends its choice with "tool_calls": its arguments are always closed."""
    return "tool_calls" if options.tool_name is not None else reason


def full_choice(
    completion: Completion,
    options: OutputOptions,
    table: LogprobTable,
    index: int,
    sequence: int,
    count: int,
    reason: str,
) -> dict[str, Any]:
    """A whole choice of `count` tokens that ended with `reason`."""
    pieces = shape_of(options).pieces(0, count, final=True)
    text = "".join(pieces)
    top = options.logprobs
    if not completion.chat:
        logprobs = None if top is None else text_logprobs(table, sequence, 0, pieces, top, 0)
        return text_choice(index, text, reason, logprobs)
    chat_lp = None if top is None else chat_logprobs(table, sequence, 0, pieces, top)
    if options.tool_name is None:
        return chat_choice(index, reason, text, logprobs=chat_lp)
    call = {
        "id": tool_call_id(),
        "type": "function",
        "function": {"name": options.tool_name, "arguments": text},
    }
    return chat_choice(
        index, finish_reason_of(options, reason), None, tool_calls=[call], logprobs=chat_lp
    )


class RichChunks:
    """One choice's SSE events rendered from dicts (the `ChoiceChunks` of non-plain choices).

    A tool call streams in OpenAI's delta shape: after the role, one delta with the call's
    id, type, name and empty arguments, then one argument fragment per token.
    """

    def __init__(
        self,
        completion: Completion,
        options: OutputOptions,
        table: LogprobTable,
        index: int,
        sequence: int,
    ) -> None:
        self._completion = completion
        self._options = options
        self._table = table
        self._index = index
        self._sequence = sequence
        self._shape = shape_of(options)
        self._text_offset = 0  # completions: where the next token's text starts

    def opening(self) -> list[bytes]:
        if not self._completion.chat:
            return []
        events = [self._event({"role": "assistant", "content": ""}, None, None)]
        if self._options.tool_name is not None:
            call = {
                "index": 0,
                "id": tool_call_id(),
                "type": "function",
                "function": {"name": self._options.tool_name, "arguments": ""},
            }
            events.append(self._event({"tool_calls": [call]}, None, None))
        return events

    def tokens(self, start: int, end: int, finish_reason: str | None) -> bytes:
        pieces = self._shape.pieces(start, end, final=finish_reason is not None)
        events = []
        for offset, piece in enumerate(pieces):
            i = start + offset
            finish = finish_reason if i == end - 1 else None
            if self._completion.chat:
                events.append(self._chat_token(i, piece, finish))
            else:
                events.append(self._text_token(i, piece, finish))
        return b"".join(events)

    def _chat_token(self, i: int, piece: str, finish: str | None) -> bytes:
        options = self._options
        delta: dict[str, Any] = {"content": piece}
        if options.tool_name is not None:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        logprobs = None
        if options.logprobs is not None:
            logprobs = chat_logprobs(self._table, self._sequence, i, [piece], options.logprobs)
        return self._event(delta, logprobs, None if finish is None else finish_reason_of(
            options, finish))  # fmt: skip

    def _text_token(self, i: int, piece: str, finish: str | None) -> bytes:
        logprobs = None
        top = self._options.logprobs
        if top is not None:
            logprobs = text_logprobs(
                self._table, self._sequence, i, [piece], top, self._text_offset
            )
        self._text_offset += len(piece)
        choice = {
            "index": self._index,
            "text": piece,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": None,
        }
        return self._completion.chunk(choice)

    def _event(
        self, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None
    ) -> bytes:
        choice = {
            "index": self._index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": None,
        }
        return self._completion.chunk(choice)
