"""How far a request has got on its replica, when the replica has not said: the tokens it has
processed (what the tenant pays for an answer that ended without usage) and written (what
its KV blocks hold, for the ledger's written view and for growing predicted reservations).
Pure functions of the request's bound and the attempt's `Outcome`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvgate.catalog import Bound
from kvgate.replicas import Replica
from kvgate.requests import ParsedRequest
from kvgate.upstream import Outcome


def processed_tokens(parsed: ParsedRequest, bound: Bound, outcome: Outcome) -> int:
    """Output tokens a replica computed for a request that ended without reporting usage.

    Streamed: the chunks relayed. Not streamed (the client gave up, or the call failed
    midway): the time the replica had at its recent pace per sequence, within max_tokens —
    what it spent on the request, so that timing out cannot beat the budget. Until the
    replica's pace is known, the whole reservation is charged.
    """
    if parsed.stream or outcome.sent_at is None:
        return outcome.streamed_tokens
    sequences = bound.prompts * parsed.sequences
    if outcome.token_rate is None:
        return bound.max_tokens * sequences
    elapsed = time.monotonic() - outcome.sent_at
    return min(bound.max_tokens, math.ceil(outcome.token_rate * elapsed)) * sequences


def written_tokens(
    parsed: ParsedRequest, bound: Bound, outcome: Outcome, replica: Replica
) -> Callable[[], int]:
    """What a request about to be sent to `replica` will have written there at any moment
    (prompt + output, all sequences): for a stream, the tokens relayed; for a whole answer,
    what the replica's decode clock advanced since it was sent, within max_tokens (until the
    clock runs, the estimate the charge uses). Always between the prompt and the worst case,
    and never less than an earlier reading."""
    start = replica.decode_clock.now()
    sequences = bound.prompts * parsed.sequences
    worst = bound.prompt_tokens + bound.max_tokens * sequences
    high = bound.prompt_tokens

    def written() -> int:
        nonlocal high
        now = replica.decode_clock.now()
        if parsed.stream or outcome.sent_at is None or start is None or now is None:
            value = bound.prompt_tokens + processed_tokens(parsed, bound, outcome)
        else:
            output = min(bound.max_tokens, math.ceil(now - start))
            value = bound.prompt_tokens + output * sequences
        high = max(high, min(worst, value))
        return high

    return written
