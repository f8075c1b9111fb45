"""Server-sent events for one or many choices, and the dropped-connection fault.

The events of every choice interleave in the order their tokens come out of the engine,
each carrying its choice's `index`; the usage event (with `stream_options.include_usage`)
and `[DONE]` come once, after the last choice ended. A plain single choice waits on its own
generation and writes whole runs of pre-rendered chunks: the simulator's hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from kvgate.sim.request import FinishReason
from kvgate.sim.responses import DONE, ChoiceChunks, Completion, error_body
from kvgate.sim.runtime import Generation, wait_any


@dataclass(slots=True)
class ChoiceStream:
    """One choice being streamed: its generation, its events, and how far it got."""

    generation: Generation
    chunks: ChoiceChunks
    sent: int = 0  # output tokens written so far
    ended: bool = False  # its finish reason was written


def drop(request: web.Request) -> ConnectionResetError:
    """Cut the connection as a crashing server would; raise the result to unwind the handler."""
    if request.transport is not None:
        request.transport.abort()
    return ConnectionResetError("connection dropped (fault injection)")


async def stream(
    request: web.Request,
    response: web.StreamResponse,
    completion: Completion,
    choices: Sequence[ChoiceStream],
    prompt_tokens: int,
    *,
    include_usage: bool,
    drop_after: int | None,
) -> web.StreamResponse:
    """Write every choice's events to a prepared response, then usage and `[DONE]`.

    `drop_after`: events left before the connection is cut (None: never); counting them
    needs one write per event, so a stream that will drop writes token by token.
    """
    budget = drop_after

    async def send(data: bytes, events: int) -> None:
        nonlocal budget
        if budget is not None:
            if budget < events:
                raise drop(request)
            budget -= events
        await response.write(data)

    for choice in choices:
        for event in choice.chunks.opening():
            await send(event, 1)
    pending = list(choices)
    while pending:
        if len(pending) == 1:
            await pending[0].generation.wait_beyond(pending[0].sent)
        else:
            await wait_any([(c.generation, c.sent) for c in pending])
        ended = False
        for choice in pending:
            generation = choice.generation
            ready, reason = generation.num_ready, generation.finish_reason
            if reason is FinishReason.ABORT:
                error = error_body("The engine aborted the request.", "InternalServerError", 500)
                await response.write(b"data: " + error + b"\n\n" + DONE)
                return response
            sent = choice.sent
            if ready > sent:
                finish = None if reason is None else reason.value
                if budget is None:
                    await send(choice.chunks.tokens(sent, ready, finish), ready - sent)
                else:
                    for i in range(sent, ready):
                        last = finish if i == ready - 1 else None
                        await send(choice.chunks.tokens(i, i + 1, last), 1)
                choice.sent = ready
            # `reason` was read with `ready`: a choice that ended during the writes above
            # still has tokens to send, and is marked ended on the next turn.
            if reason is not None:
                choice.ended = ended = True
        if ended:
            pending = [c for c in pending if not c.ended]
    completion_tokens = sum(c.sent for c in choices)
    tail = completion.usage_chunk(prompt_tokens, completion_tokens) if include_usage else b""
    await send(tail + DONE, 2 if include_usage else 1)
    await response.write_eof()
    return response
