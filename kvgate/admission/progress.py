"""How far a request has got on its replica, when the replica has not said: the tokens it has
processed (what the tenant pays for an answer that ended without usage) and written (what
its KV blocks hold, for the ledger's written view and for growing predicted reservations).
Pure functions of the request's bound and the attempt's `Outcome`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvgate.request.catalog import Bound
from kvgate.request.parsed import ParsedRequest
from kvgate.transport.base import Outcome


def processed_tokens(parsed: ParsedRequest, bound: Bound, outcome: Outcome) -> int:
    """Output tokens a replica computed for a request that ended without reporting usage.

    Streamed through kvgate: the chunks relayed. Otherwise (a whole answer the client gave up
    on, or a call that failed midway; a stream whose body went past kvgate): what the replica's decode clock advanced from sending until now — its own count
    of the tokens each of its sequences produced meanwhile, read from its /metrics — per
    sequence, within max_tokens: what it spent on the request, so that timing out cannot beat
    the budget. The caller has the replica's figures read after the request ended
    (`replicas.metrics_after`), so that the clock covers its end, not an extrapolation. Until
    the replica's clock runs, the whole reservation is charged.
    """
    if outcome.counted(parsed.stream) or outcome.sent_at is None:
        return outcome.streamed_tokens
    sequences = bound.prompts * parsed.sequences
    clock = None if outcome.replica is None else outcome.replica.decode_clock
    now = None if clock is None else clock.reading()
    if now is None or outcome.decode_start is None:
        return bound.max_tokens * sequences
    return min(bound.max_tokens, max(0, round(now - outcome.decode_start))) * sequences


def written_tokens(parsed: ParsedRequest, bound: Bound, outcome: Outcome) -> Callable[[], int]:
    """What a request will have written on the replica it is sent to at any moment (prompt +
    output, all sequences): for a stream, the tokens relayed; for a whole answer, what the
    replica's decode clock advanced since it was sent, rounded up, within max_tokens (until
    the clock runs, only its prompt is known: a reservation grown to its worst case on no
    evidence would hold, with no max_tokens sent, the whole context). Always between the
    prompt and the worst case, and never less than an earlier reading."""
    sequences = bound.prompts * parsed.sequences
    worst = bound.prompt_tokens + bound.max_tokens * sequences
    high = bound.prompt_tokens

    def written() -> int:
        nonlocal high
        start, replica = outcome.decode_start, outcome.replica
        now = None if replica is None else replica.decode_clock.now()
        if outcome.counted(parsed.stream) or outcome.sent_at is None:
            value = bound.prompt_tokens + processed_tokens(parsed, bound, outcome)
        elif start is None or now is None:
            value = bound.prompt_tokens  # no clock yet: its prediction stands, not its worst
        else:
            output = min(bound.max_tokens, math.ceil(now - start))
            value = bound.prompt_tokens + output * sequences
        high = max(high, min(worst, value))
        return high

    return written
