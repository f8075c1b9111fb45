"""A transport that judges each attempt for the replica's circuit (Envoy's outlier detection).

Two verdicts per attempt, both given to `Breakers.judge` with the request as holder:
- when the response headers arrive, by their status alone (2xx/3xx: it answered; 4xx/5xx:
  nothing yet), so a half-open replica's trial is decided then, not held open while its
  answer streams;
- when the attempt ends (its response closed, or `send` raised), by the whole attempt
  (`replica_failed`): unreachable, 5xx, a stream broken or silent past a timeout count as
  failures; vLLM's busy 503, a client that left, a slow whole answer say nothing.
"""

from __future__ import annotations

import dataclasses

from kvgate.fleet.health import Breakers
from kvgate.transport.base import Transport, UpstreamRequest, UpstreamResponse
from kvgate.transport.failover import replica_failed


class BreakerTransport:
    def __init__(self, inner: Transport, breakers: Breakers) -> None:
        self.inner = inner
        self.breakers = breakers

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        try:
            response = await self.inner.send(request)
        except BaseException:
            self.judge_attempt(request)
            raise
        answered = False if response.status < 400 else None
        self.breakers.judge(request.replica.id, answered, request.holder)
        inner_close = response.aclose

        async def aclose() -> None:
            try:
                await inner_close()
            finally:
                self.judge_attempt(request)

        return dataclasses.replace(response, aclose=aclose)

    def judge_attempt(self, request: UpstreamRequest) -> None:
        """The attempt is over: what it showed of its replica."""
        failed = replica_failed(request.attempt, request.stream)
        self.breakers.judge(request.replica.id, failed, request.holder)
