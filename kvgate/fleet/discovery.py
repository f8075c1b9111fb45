"""Discovery: every replica's /health, /v1/models and /metrics, read in the background each
`discovery.interval_s`, never on a request's path: a slow or dead replica makes its figures
stale, never a request slow. Figures older than `stale_after_s` read as unknown; a replica
whose capacity is unknown (and not given in config) is not admitted to.

Unhealthy means failing, not late: a replica leaves rotation once `failure_threshold` checks
in a row have failed (no answer within `timeout_s`, or a 5xx), or at once when nothing
listens at its address; a check that only came late while the replica answers our requests
is no failure at all. A real vLLM's API server shares its CPU with the engine's loop and
answers /v1/models late while it generates (tests/real): one late answer is no verdict.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import orjson

from kvgate.config import CurrentConfig, DiscoveryConfig
from kvgate.fleet.replicas import Registry, Replica
from kvgate.fleet.scrape import read_metrics
from kvgate.intervals import pause

log = logging.getLogger(__name__)


async def discover(
    session: aiohttp.ClientSession, replica: Replica, config: DiscoveryConfig
) -> None:
    """Refresh one replica; on any failure mark it unhealthy and keep its last figures."""
    headers = {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    try:
        async with session.get(f"{replica.url}/health", timeout=timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"/health answered {resp.status}")
        async with session.get(f"{replica.url}/v1/models", headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"/v1/models answered {resp.status}")
            listing = orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
        late = isinstance(exc, TimeoutError)
        recent = config.interval_s * config.failure_threshold + config.timeout_s
        if late and time.monotonic() - replica.answered_at < recent:
            return  # busy answering requests, which is the opposite of failing
        replica.failed_checks += 1
        replica.last_error = str(exc) or type(exc).__name__
        refused = isinstance(exc, aiohttp.ClientConnectorError)  # nothing listens there
        if replica.healthy and (refused or replica.failed_checks >= config.failure_threshold):
            log.warning("replica %s is unhealthy after %d failed checks: %s",
                        replica.id, replica.failed_checks, replica.last_error)
            replica.healthy = False
        return
    # A slow or failing /metrics leaves the figures stale (then unknown), never the replica
    # out of rotation: routing and admission fall back to the ledger alone.
    await read_metrics(session, replica, config.timeout_s)
    now = time.monotonic()
    models = {}
    for entry in listing.get("data", []) if isinstance(listing, dict) else []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            length = entry.get("max_model_len")
            models[entry["id"]] = length if isinstance(length, int) else None
    replica.models = frozenset(models)
    replica.max_model_lens = {m: n for m, n in models.items() if n is not None}
    if not replica.healthy:
        log.info("replica %s is healthy", replica.id)
    replica.healthy = True
    replica.failed_checks = 0
    replica.last_seen = now
    replica.last_error = None


async def discovery_loop(
    session: Callable[[], aiohttp.ClientSession | None],
    registry: Registry,
    current: CurrentConfig,
    after_round: Callable[[], None] = lambda: None,
    first_round: asyncio.Event | None = None,
) -> None:
    """Scrape every replica each `discovery.interval_s` of the config in force, all at once,
    until cancelled; `after_round` runs after each round (new figures may let queued requests
    in), and `first_round` is set once the first is done."""
    while True:
        settings, client = current().discovery, session()
        registry.prune()
        if client is not None:
            await asyncio.gather(*(discover(client, r, settings) for r in registry))
        after_round()
        if first_round is not None:
            first_round.set()
        await pause(lambda: current().discovery.interval_s)


def first_round_within(config: DiscoveryConfig) -> float:
    """How long the first round of discovery may take: a replica's /health, /v1/models and
    /metrics, each within `timeout_s`, and a second to spare."""
    return 3 * config.timeout_s + 1.0
