"""The attempts stage: how often, and where, a request is tried (Envoy's router retry policy).

One attempt admits the request on the router's best replica with room, forwards it and relays
the answer (`Gateway.attempt`). Around it:
- a replica that failed before any byte reached the client (`retry_reason`) is excluded and
  the request goes once more elsewhere, up to `routing.retry.attempts` times (the blocks are
  reserved again there; the tenant is charged once);
- a replica whose vLLM refused it as busy (backpressure, not a failure) takes no more for
  now: the request is placed again, on another replica or from the queue, within what is
  left of its wait budget (`Exchange.since`), as often as that allows;
- when nowhere else takes it, the replica's failure stands rather than the later refusal;
- where the data plane sent the request itself (behind Envoy, `retries` False), nothing is
  tried again: a failure stands, and a busy replica is the client's 429 with `Retry-After`.

Each try appends its `Outcome` to the exchange; the last is what the tenant pays for. At the
end, a half-open replica's trial the request claimed and never used goes to the next one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvgate.errors import NeverFits, NoReplica, RateLimited, ReplicaBusy, ServerError
from kvgate.exchange import Exchange
from kvgate.fleet.health import Breakers
from kvgate.metrics import Metrics
from kvgate.transport.base import Outcome
from kvgate.transport.failover import retry_reason

T = TypeVar("T")


class Attempts:
    def __init__(self, breakers: Breakers, metrics: Metrics) -> None:
        self.breakers = breakers
        self.metrics = metrics

    async def run(
        self, x: Exchange, attempt: Callable[[Exchange], Awaitable[T]], *, retries: bool = True
    ) -> T:
        """`attempt(x)` until one returns, or fails in a way no other replica would mend; only
        once where the data plane cannot send a request again (`retries` False)."""
        failed: ServerError | None = None  # the last replica's failure, while it stands
        failures = 0
        retry = x.rt.config.routing.retry
        try:
            while True:
                asked = time.monotonic()
                try:
                    return await attempt(x)
                except ReplicaBusy as exc:
                    if not retries:  # sent once (behind Envoy): the client hears kvgate's 429
                        raise RateLimited(
                            f"{exc.message}; try again shortly", code="replica_busy",
                            retry_after_s=x.rt.config.admission.busy_backoff_s,
                        ) from None
                    # the busy replica takes no more for now (Admission.refused_busy): the
                    # request goes elsewhere, or waits for room, on the wait it has left
                    x.since = asked if x.since is None else x.since
                    failed = None  # a 429 in time beats an earlier replica's failure
                except (NoReplica, NeverFits, RateLimited):
                    if failed is not None:  # nowhere else to go: the replica's failure stands
                        raise failed from None
                    raise
                except ServerError as exc:
                    reason = retry_reason(exc, x.attempt, retry) if retries else None
                    if reason is None or failures >= retry.attempts:
                        raise
                    replica = x.replica
                    assert replica is not None  # the failed attempt was admitted there
                    self.metrics.upstream_retries.labels(x.demand.pool, reason).inc()
                    x.exclude(replica)
                    failed, failures = exc, failures + 1
                x.attempts.append(Outcome())
        finally:
            self.breakers.release(x.key)
