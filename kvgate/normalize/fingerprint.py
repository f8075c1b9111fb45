"""Fingerprints of the shared prefix of a chat — its tools block and its leading system
messages, as normalized — and the tracker that makes system-prompt drift visible.

A fingerprint is 16 hex digits of `kvgate.digest` over the model, the canonical JSON of the
tools and the text of each leading system (or developer) message: what vLLM renders first,
and so what its prefix cache can share between requests. Two requests with the same
fingerprint share that prefix byte for byte; routing uses it as the prefix-affinity key.
Text completions and chats with neither a system message nor tools have none.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.digest import digest
from kvgate.normalize.config import FingerprintConfig
from kvgate.normalize.relocate import SYSTEM_ROLES
from kvgate.request.parsed import Endpoint, ParsedRequest
from kvgate.request.tokens import message_text

log = logging.getLogger(__name__)


def fingerprint(parsed: ParsedRequest) -> str | None:
    if parsed.endpoint is not Endpoint.CHAT:
        return None
    body = parsed.body
    tools = body.get("tools") or body.get("functions")
    systems = leading_system_texts(parsed.messages)
    if not systems and not tools:
        return None
    try:
        tools_json = orjson.dumps(tools) if tools else b""  # as forwarded: canonical once normalized
    except orjson.JSONEncodeError:  # nested too deep: the counter answers a 400
        return None
    return digest(parsed.model, tools_json, *systems, size=8).hex()


def leading_system_texts(messages: list[Any]) -> list[str]:
    texts = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in SYSTEM_ROLES:
            break
        texts.append(message_text(message.get("content")))
    return texts


def preview(parsed: ParsedRequest, chars: int) -> str:
    return "\n".join(leading_system_texts(parsed.messages))[:chars]


@dataclass(slots=True)
class Entry:
    tenant: str
    model: str
    fingerprint: str
    first_seen: float
    last_seen: float
    preview: str | None = None
    current: int = 0  # requests in the current half window
    previous: int = 0  # requests in the half window before it

    @property
    def requests(self) -> int:
        return self.current + self.previous


class Tracker:
    """The live fingerprints per tenant and model, and their changes.

    A change is a fingerprint a tenant sends for a model that differs from the last one it
    sent and is not among its live ones: a deploy that edits the system prompt counts once,
    a tenant that alternates between two prompts does not. Requests are counted in two half
    windows, so a figure covers between half a window and a whole one; a fingerprint unseen
    for a window is forgotten. Only the event loop thread calls it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.entries: OrderedDict[tuple[str, str, str], Entry] = OrderedDict()  # oldest first
        self.latest: dict[tuple[str, str], str] = {}
        self._half_started = clock()
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # last line, changes since

    def observe(self, tenant: str, model: str, key: str, config: FingerprintConfig,
                text: Callable[[], str] | None = None) -> str | None:  # fmt: skip
        """Count one request; the tenant's previous fingerprint if this one is a change."""
        now = self.clock()
        self._rotate(now, config.window_s)
        entry = self.entries.get((tenant, model, key))
        old = None
        if entry is None:
            last = self.latest.get((tenant, model))
            old = last if last is not None and last != key else None
            entry = Entry(tenant, model, key, now, now)
            if config.preview and text is not None:
                entry.preview = text()[: config.preview_chars]
            self.entries[(tenant, model, key)] = entry
            while len(self.entries) > config.max_tracked:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end((tenant, model, key))
        entry.current += 1
        entry.last_seen = now
        self.latest[(tenant, model)] = key
        if old is not None:
            self._log_change(tenant, model, old, key, now, config.log_interval_s)
        return old

    def _rotate(self, now: float, window_s: float) -> None:
        half = window_s / 2
        if now - self._half_started < half:
            return
        halves = int((now - self._half_started) // half)
        self._half_started += halves * half
        for entry in self.entries.values():
            entry.previous = entry.current if halves == 1 else 0
            entry.current = 0
        while self.entries:
            oldest = next(iter(self.entries.values()))
            if now - oldest.last_seen <= window_s:
                break
            self.entries.popitem(last=False)

    def _log_change(self, tenant: str, model: str, old: str, new: str, now: float,
                    interval_s: float) -> None:  # fmt: skip
        last, since = self._logged.get((tenant, model), (None, 0))
        if last is not None and now - last < interval_s:
            self._logged[(tenant, model)] = (last, since + 1)
            return
        more = f" ({since} more changes since the last line)" if since else ""
        log.warning("system prompt changed: tenant %s, model %s, fingerprint %s -> %s%s",
                    tenant, model, old, new, more)
        self._logged[(tenant, model)] = (now, 0)

    def live(self, config: FingerprintConfig) -> list[Entry]:
        self._rotate(self.clock(), config.window_s)
        return [e for e in self.entries.values() if e.requests]

    def top(self, config: FingerprintConfig) -> tuple[list[tuple[str, int]], int]:
        """Requests per fingerprint (over every tenant): the busiest top_n, and the rest."""
        counts: Counter[str] = Counter()
        for entry in self.live(config):
            counts[entry.fingerprint] += entry.requests
        ranked = counts.most_common()
        top = ranked[: config.top_n]
        return top, sum(n for _, n in ranked[config.top_n:])

    def per_tenant(self, config: FingerprintConfig) -> Counter[str]:
        """Distinct live fingerprints per tenant."""
        return Counter(entry.tenant for entry in self.live(config))

    def snapshot(self, config: FingerprintConfig) -> dict[str, Any]:
        """What /admin/prompts shows: every live fingerprint, busiest first."""
        now = self.clock()
        entries = sorted(self.live(config), key=lambda e: -e.requests)
        total = sum(e.requests for e in entries)
        tenants: Counter[str] = Counter()
        for e in entries:
            tenants[e.tenant] += e.requests
        rows = []
        for e in entries:
            row: dict[str, Any] = {
                "fingerprint": e.fingerprint, "tenant": e.tenant, "model": e.model,
                "requests": e.requests,
                "share": round(e.requests / total, 4) if total else 0.0,
                "tenant_share": round(e.requests / tenants[e.tenant], 4),
                "current_for_tenant": self.latest.get((e.tenant, e.model)) == e.fingerprint,
                "first_seen_s_ago": round(now - e.first_seen, 1),
                "last_seen_s_ago": round(now - e.last_seen, 1),
            }
            if config.preview:
                row["preview"] = e.preview
            rows.append(row)
        return {"window_s": config.window_s, "requests": total, "fingerprints": rows}
