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
import time
from collections.abc import Mapping
from typing import Any

import orjson

from kvgate.config import SessionsConfig
from kvgate.errors import KvgateError
from kvgate.metrics import Metrics
from kvgate.requests import ParsedRequest
from kvgate.routing.fleet import Fleet
from kvgate.state.base import StateStore, StateStoreError

log = logging.getLogger(__name__)

# Recently read bindings, so a request retried from the queue every few milliseconds does not
# read the store each time.
CACHE_S = 1.0
# A binding this instance wrote (or confirmed) to the same replica less than this long ago
# (at most a tenth of its TTL) is not written again: a session's every request wrote the store
# only to push its TTL on (issue 14). It may so expire up to this much earlier.
REFRESH_S = 60.0
CACHE_MAX = 10_000
MAX_HEADER_KEY = 256


def session_key(
    parsed: ParsedRequest, headers: Mapping[str, str], config: SessionsConfig
) -> str | None:
    """The request's session key from the first configured source that has one."""
    for source in config.sources:
        if source == "header":
            value = headers.get(config.header, "")
            if 0 < len(value) <= MAX_HEADER_KEY and value.isprintable():
                return f"h:{value}"
        elif source == "user" and parsed.user:
            return f"u:{parsed.user}"
        elif source == "conversation":
            digest = conversation_digest(parsed, config.conversation_messages)
            if digest is not None:
                return f"c:{digest}"
    return None


def conversation_digest(parsed: ParsedRequest, messages: int) -> str | None:
    """A hash of the conversation's first `messages` messages (chats only), with at least one
    user message among them: the same in every turn of one chat, different between chats."""
    head = parsed.messages[:messages]
    if not any(isinstance(m, dict) and m.get("role") == "user" for m in head):
        return None
    canonical: list[Any] = [[m.get("role"), m.get("content")] for m in head if isinstance(m, dict)]
    raw = orjson.dumps([parsed.model, canonical], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


class Sessions:
    def __init__(self, store: StateStore, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        self._cache: dict[str, tuple[str | None, float]] = {}
        self._written: dict[str, tuple[str, float]] = {}  # session -> (replica, when bound)

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
            log.debug("session lookup failed: %s", exc)
            return None
        self._remember(session, replica, now)
        return replica

    async def ran_on(
        self, session: str, replica_id: str, fleet: Fleet, ttl_s: float
    ) -> None:
        """The request of `session` was admitted on `replica_id`: bind (or rebind) the session
        there and count what happened."""
        before = await self.bound(session)
        result, reason = "hit", "bound"
        if before is None:
            result, reason = "new", "unbound"
        elif before != replica_id:
            result, reason = "rebound", why_not(before, fleet)
        now = time.monotonic()
        written = self._written.get(session)
        if (
            result == "hit" and written is not None and written[0] == replica_id
            and now - written[1] < min(REFRESH_S, ttl_s / 10)
        ):  # fmt: skip
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
        self._remember(session, now_bound, time.monotonic())
        if now_bound == replica_id:
            if len(self._written) >= CACHE_MAX:
                self._written.clear()  # bounded; a forgotten one is written once more
            self._written[session] = (replica_id, now)
        self.metrics.session_routes.labels(result, reason).inc()

    def _remember(self, session: str, replica: str | None, at: float) -> None:
        if len(self._cache) >= CACHE_MAX:
            self._cache.clear()  # crude but bounded; entries live a second anyway
        self._cache[session] = (replica, at)


def why_not(replica_id: str, fleet: Fleet) -> str:
    """Why a session left the replica it was bound to."""
    view = fleet.get(replica_id)
    if view is None:
        return "gone"
    if view.draining:
        return "draining"
    if view.circuit == "open":
        return "circuit_open"
    if not view.healthy:
        return "unhealthy"
    return "busy"
