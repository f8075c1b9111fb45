"""Sticky sessions: the session key of a request, and its binding to a replica in the state
store (shared by every instance, surviving a restart with Redis, refreshed on every use).

Affinity never overrides capacity: a bound replica that is gone, unhealthy, draining,
circuit-open or without room within `affinity_wait_s` is replaced, and the session rebound to
where the request ran. Every outcome is counted in `kvgate_session_routes_total{result,reason}`.
A store that fails makes sessions best effort (counted as reason="store_error"), never a
request fail.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import orjson

from kvgate.config import SessionsConfig
from kvgate.digest import digest
from kvgate.errors import KvgateError
from kvgate.fleet.snapshot import Fleet
from kvgate.metrics import Metrics
from kvgate.request.parsed import ParsedRequest
from kvgate.state.base import StateStore, StateStoreError

log = logging.getLogger(__name__)

# Recently read bindings, so a request retried from the queue every few milliseconds does not
# read the store each time.
CACHE_S = 1.0
CACHE_MAX = 10_000
MAX_HEADER_KEY = 256


def session_key(
    parsed: ParsedRequest, headers: Mapping[str, str], config: SessionsConfig, tenant: str
) -> str | None:
    """The request's session key from the first configured source that has one: a fixed-size
    hash of the tenant, the model and the value, so that one tenant cannot reach another's
    sessions, a session of two models is two sessions, and no client-sized value becomes a
    store key."""
    for source in config.sources:
        value = None
        if source == "header":
            given = headers.get(config.header, "")
            if 0 < len(given) <= MAX_HEADER_KEY and given.isprintable():
                value = given
        elif source == "user" and parsed.user:
            value = parsed.user
        elif source == "conversation":
            value = conversation_digest(parsed, config.conversation_messages)
        if value is not None:
            scoped = "\0".join((tenant, parsed.model, source, value)).encode()
            return f"{source[0]}:{hashlib.blake2b(scoped, digest_size=16).hexdigest()}"
    return None


def conversation_digest(parsed: ParsedRequest, messages: int) -> str | None:
    """A hash of the conversation's first `messages` messages (chats only), with at least one
    user message among them: the same in every turn of one chat, different between chats."""
    head = parsed.messages[:messages]
    if not any(isinstance(m, dict) and m.get("role") == "user" for m in head):
        return None
    canonical: list[Any] = [[m.get("role"), m.get("content")] for m in head if isinstance(m, dict)]
    raw = orjson.dumps([parsed.model, canonical], option=orjson.OPT_SORT_KEYS)
    return digest(raw, size=12).hex()


class Sessions:
    def __init__(self, store: StateStore, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        self._cache: dict[str, tuple[str | None, float]] = {}
        self._refreshed: dict[str, float] = {}  # session -> when this instance last bound it

    @staticmethod
    def store_key(session: str) -> str:
        return f"session:{session}"

    async def bound(self, session: str) -> str | None:
        """The replica the session is bound to, if any."""
        now = time.monotonic()
        cached = self._cache.get(session)
        if cached is not None and now - cached[1] < CACHE_S:
            return cached[0]
        try:
            replica = await self.store.lookup(self.store_key(session))
        except (StateStoreError, KvgateError) as exc:
            # sessions are best effort: the request is routed as if unbound, and counted
            log.warning("session lookup failed, routing as unbound: %s", exc)
            self.metrics.session_routes.labels("new", "store_error").inc()
            return None
        self._remember(session, replica, now)
        return replica

    async def ran_on(
        self, session: str, replica_id: str, fleet: Fleet | None, ttl_s: float
    ) -> None:
        """The request of `session` was served by `replica_id`: bind (or rebind) the session
        there for `ttl_s`, and count what happened. A binding this instance refreshed within
        the last quarter of its TTL is not written again."""
        before = await self.bound(session)
        result, reason = "hit", "bound"
        now = time.monotonic()
        if before is None:
            result, reason = "new", "unbound"
        elif before != replica_id:
            result, reason = "rebound", why_not(before, fleet)
        elif now - self._refreshed.get(session, -math.inf) < ttl_s / 4:
            self.metrics.session_routes.labels(result, reason).inc()
            return
        try:
            now_bound = await self.store.bind(
                self.store_key(session), replica_id, ttl_s, replace=before
            )
        except (StateStoreError, KvgateError) as exc:
            log.debug("session bind failed: %s", exc)
            self.metrics.session_routes.labels(result, "store_error").inc()
            return
        self._remember(session, now_bound, now)
        if now_bound == replica_id:
            if len(self._refreshed) >= CACHE_MAX:
                self._refreshed.clear()  # bounded; the next request of each just binds again
            self._refreshed[session] = now
        self.metrics.session_routes.labels(result, reason).inc()

    def forget_reads(self) -> None:
        """Forget the bindings read lately: the next lookups read the store."""
        self._cache.clear()

    def _remember(self, session: str, replica: str | None, at: float) -> None:
        if len(self._cache) >= CACHE_MAX:
            self._cache.clear()  # bounded; entries live a second anyway
        self._cache[session] = (replica, at)


def why_not(replica_id: str, fleet: Fleet | None) -> str:
    """Why a session left the replica it was bound to."""
    view = fleet.get(replica_id) if fleet is not None else None
    if view is None:
        return "gone"
    if view.draining:
        return "draining"
    if view.circuit == "open":
        return "circuit_open"
    if not view.healthy:
        return "unhealthy"
    return "busy"
