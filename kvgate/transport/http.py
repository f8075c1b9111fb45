"""The HTTP transport: the one pooled aiohttp client session towards the replicas.

It is created with its session once the event loop runs (`app._upstream`) and lives as long
as the session; a reload that changes `upstream` replaces the transport whole, and the old
one closes once the requests using it can have finished. Besides `send`, it reads a replica's
/metrics on the same session when the gateway needs figures that cover a request's end.
"""

from __future__ import annotations

import asyncio
import functools
import time

import aiohttp

from kvgate.config import TimeoutsConfig
from kvgate.errors import NoHeadersInTime, ServerError, StreamBroke, Unreachable
from kvgate.fleet.replicas import Replica
from kvgate.fleet.scrape import metrics_read_after
from kvgate.transport.base import Outcome, UpstreamRequest, UpstreamResponse


class HttpTransport:
    """Sends over the pooled client session, under the timeouts of the request's own config."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._reads: set[asyncio.Task[bool]] = set()  # reads of /metrics under way

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        """POST the body; the answer once its headers arrived, within first_byte_s (and
        total_s). A failure before that raises, `request.attempt` saying what it was."""
        t, replica, attempt = request.timeouts, request.replica, request.attempt
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, connect=t.connect_s)
        deadline = time.monotonic() + t.total_s
        attempt.sent_at = time.monotonic()
        try:
            async with asyncio.timeout(min(t.first_byte_s, t.total_s)):
                upstream = await self.session.post(
                    f"{replica.url}{request.path}", data=request.body, headers=request.headers,
                    timeout=timeout, auto_decompress=False,
                )
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise attempt.fail(failure(exc, replica.id, t)) from None
        attempt.status = upstream.status
        replica.answered_at = time.monotonic()  # alive, whatever discovery's checks say
        return UpstreamResponse(
            request, upstream.status, deadline,
            read=upstream.read, readany=upstream.content.readany,
            aclose=functools.partial(_give_back, upstream),
        )

    def read_metrics(
        self, replica: Replica, after: float, timeout_s: float
    ) -> asyncio.Task[bool] | None:
        """A read of the replica's /metrics sent after `after`, shared with whoever else wants
        one since then (`scrape.metrics_read_after`); None once the session is closed. The
        transport holds it until it ends, and `close` ends those still under way."""
        if self.session.closed:
            return None
        read = metrics_read_after(self.session, replica, after, timeout_s)
        if read not in self._reads and not read.done():
            self._reads.add(read)
            read.add_done_callback(self._reads.discard)
        return read

    async def figures_after(self, outcome: Outcome, timeout_s: float) -> None:
        """Until the replica's figures (its decode clock) cover the end of the request that
        `outcome` tells of: a read of /metrics sent after kvgate closed the connection, so
        that what the replica did until it saw the end is counted, not extrapolated. Bounded
        by `timeout_s`; if it fails, the extrapolation stands."""
        if outcome.replica is None or outcome.ended_at is None:
            return
        read = self.read_metrics(outcome.replica, outcome.ended_at, timeout_s)
        if read is not None:
            await asyncio.wait([read])  # shared: its failure or end is not ours to raise

    async def close(self) -> None:
        """End the reads of /metrics under way (the app is stopping), then the session."""
        reads = list(self._reads)
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        await self.session.close()


async def _give_back(upstream: aiohttp.ClientResponse) -> None:
    """The connection goes back to the pool (closed instead if its body was not read whole)."""
    upstream.release()
    await upstream.wait_for_close()


def failure(exc: TimeoutError | aiohttp.ClientError, replica_id: str, t: TimeoutsConfig) -> ServerError:
    """What aiohttp's error before the response headers means, as kvgate's failure type: the
    one table for the HTTP transport (the relay's failures after the headers are its own)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # (also a TimeoutError)
        return Unreachable(f"replica {replica_id} could not be reached within {t.connect_s:g}s")
    if isinstance(exc, TimeoutError):
        return NoHeadersInTime(f"replica {replica_id} did not answer within {t.first_byte_s:g}s")
    message = f"replica {replica_id} could not be reached: {exc}"
    if isinstance(exc, aiohttp.ClientConnectorError):  # nothing listens there
        return Unreachable(message)
    return StreamBroke(message)  # the connection broke before the headers
