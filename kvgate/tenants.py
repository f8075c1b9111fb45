"""Tenants: who is asking (API-key hash, or a trusted header), and their token budgets.

Budgets are charged in tokens, not requests: at admission a request is charged its worst case
(prompt + max_tokens) and one request; when it ends the charge is settled to what vLLM reports
it used (the unused part refunded, an undercount charged), and a request that failed before
its first token is refunded whole. Each step is one atomic state-store call, so several kvgate
instances on one Redis enforce one limit. A tenant's concurrent requests are leases, so a
crashed instance's count comes back by itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from kvgate.config import AuthConfig, TenantConfig
from kvgate.errors import BadRequest, Forbidden, KvgateError, OverBudget, Unauthorized
from kvgate.leases import LeaseKeeper
from kvgate.metrics import Metrics
from kvgate.protect import acquire, finish, together
from kvgate.state.base import BucketLimit, BucketState, StateStore, StateStoreError

log = logging.getLogger(__name__)


ANONYMOUS = TenantConfig(name="anonymous")
CONCURRENCY_TTL_S = 30.0


class Directory:
    """Finds the tenant of a request. Built from config; rebuilt on reload."""

    def __init__(self, auth: AuthConfig, tenants: list[TenantConfig]) -> None:
        self.auth = auth
        self._by_name = {t.name: t for t in tenants}
        self._digests = [(bytes.fromhex(d), t) for t in tenants for d in t.api_key_sha256]
        self._trusted = [ipaddress.ip_network(n, strict=False) for n in auth.trusted_networks]

    def identify(self, headers: Mapping[str, str], peer: str | None) -> TenantConfig:
        if self.auth.mode == "none":
            return self._anonymous() or ANONYMOUS
        if self.auth.mode == "trusted_header":
            claimed = headers.get(self.auth.tenant_header)
            if claimed is not None:
                if not self._is_trusted(peer):
                    raise Unauthorized(
                        f"{self.auth.tenant_header} is only accepted from trusted networks"
                    )
                tenant = self._by_name.get(claimed)
                if tenant is None:
                    raise Unauthorized(f"unknown tenant {claimed!r}")
                return tenant
        key = _bearer(headers.get("Authorization"))
        if key is None:
            anonymous = self._anonymous()
            if anonymous is None:
                raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
            return anonymous
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for candidate, tenant in self._digests:  # compare against all: constant time per key
            if hmac.compare_digest(candidate, digest):
                found = tenant
        if found is None:
            raise Unauthorized("invalid API key")
        return found

    def _anonymous(self) -> TenantConfig | None:
        name = self.auth.anonymous_tenant
        return self._by_name.get(name) if name else None

    def _is_trusted(self, peer: str | None) -> bool:
        if not peer:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in net for net in self._trusted)


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def check_access(tenant: TenantConfig, model: str) -> None:
    if tenant.models is not None and model not in tenant.models:
        raise Forbidden(f"tenant {tenant.name!r} may not use model {model!r}", code="model_not_allowed")


@dataclass(slots=True)
class Charge:
    """A tenant's hold for one request: settle it with the real usage before leaving."""

    tenant: TenantConfig
    reserved_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False
    slot: ConcurrencySlot | None = None  # the tenant's concurrency lease, when it has a limit


@dataclass(slots=True)
class ConcurrencySlot:
    """One of a tenant's `max_concurrent` requests: a lease in `concurrency:<tenant>`."""

    pool: str
    lease_id: str
    limit: int
    ttl_s: float
    held: bool = False


class Budgets:
    """Charges and settles tenants' budgets in `store`.

    A tenant's concurrent requests are leases in `concurrency:<tenant>`. With a `keeper` (the
    one that renews the ledger's leases) they last `keeper.ttl_s` and are renewed while the
    request runs, so a killed instance's count comes back within that TTL; without one they
    last CONCURRENCY_TTL_S unrenewed (a request running longer than that stops counting).

    Round trips (issue 14): the three holds of a charge — the concurrency lease, one request
    and the worst case in tokens — are taken together (one pipeline with the Redis store),
    each still one atomic script; when one is refused, the others are given back. Settling
    corrects the tokens and frees the concurrency slot together too.
    """

    def __init__(
        self, store: StateStore, metrics: Metrics, keeper: LeaseKeeper | None = None
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.keeper = keeper
        self._durations: dict[str, float] = {}  # recent mean request duration per tenant

    @contextlib.asynccontextmanager
    async def charge(
        self, tenant: TenantConfig, worst_tokens: int, max_hold_s: float | None = None
    ) -> AsyncIterator[Charge]:
        """Charge one request and its worst case; on exit, refund whatever `settle` did not
        account for (everything, if the request never ran). `max_hold_s`: the longest the
        request may run; a concurrency lease held longer is dropped as leaked."""
        tpm, rpm = _limits(tenant)
        if tpm is not None and worst_tokens > tpm.capacity:
            raise BadRequest(
                f"this request's worst case of {worst_tokens} tokens exceeds tenant "
                f"{tenant.name!r}'s budget of {tpm.capacity} tokens per minute; lower max_tokens",
                code="exceeds_token_budget", param="max_tokens",
            )
        charge = Charge(tenant, worst_tokens)
        if tenant.max_concurrent is not None:
            ttl_s = self.keeper.ttl_s if self.keeper is not None else CONCURRENCY_TTL_S
            charge.slot = ConcurrencySlot(
                f"concurrency:{tenant.name}", os.urandom(12).hex(), tenant.max_concurrent, ttl_s
            )

        async def give_back(_: None = None) -> None:
            async with _settling(charge):
                await self._refund(charge, worst_tokens, tpm)

        async def give_all_back(_: None = None) -> None:
            for outcome in await together(give_back(), self._free(charge)):
                if isinstance(outcome, BaseException):
                    raise outcome

        started = time.monotonic()
        await acquire(self._take(charge, rpm, tpm), give_all_back)
        slot = charge.slot
        if slot is not None and self.keeper is not None:
            self.keeper.add(
                slot.pool, slot.lease_id, max_age_s=max_hold_s,
                on_stale=lambda: self._free(charge),
            )
        gauge = self.metrics.tenant_concurrency.labels(tenant.name)
        gauge.inc()
        try:
            yield charge
        finally:
            gauge.dec()
            self._observe_duration(tenant.name, time.monotonic() - started)
            if not charge.settled:
                charge.settled = True
                await finish(give_all_back())
            else:
                await finish(self._free(charge))  # settled: freed already, unless that failed

    async def settle(self, charge: Charge, prompt_tokens: int, completion_tokens: int) -> None:
        """Correct the charge to actual usage (refund the unused part or charge the excess)
        and free the tenant's concurrency slot: the request is over. Runs to its end whatever
        cancellation arrives meanwhile."""
        if charge.settled:
            return
        charge.settled = True
        for outcome in await finish(together(
            self._settle(charge, prompt_tokens, completion_tokens), self._free(charge)
        )):  # fmt: skip
            if isinstance(outcome, BaseException):
                raise outcome

    async def _settle(self, charge: Charge, prompt_tokens: int, completion_tokens: int) -> None:
        tpm, _ = _limits(charge.tenant)
        name = charge.tenant.name
        self.metrics.tenant_tokens.labels(name, "prompt").inc(prompt_tokens)
        self.metrics.tenant_tokens.labels(name, "completion").inc(completion_tokens)
        delta = charge.reserved_tokens - (prompt_tokens + completion_tokens)
        async with _settling(charge):
            if delta > 0:
                await self._refund(charge, delta, tpm)
            elif delta < 0 and tpm is not None:
                state = await self.store.take(_bucket(name, "tokens"), -delta, tpm, force=True)
                self.metrics.tenant_remaining_tokens.labels(name).set(state.remaining)

    async def _refund(self, charge: Charge, tokens: int, tpm: BucketLimit | None) -> None:
        name = charge.tenant.name
        self.metrics.tenant_tokens.labels(name, "refunded").inc(tokens)
        if tpm is not None and tokens > 0:
            state = await self.store.put_back(_bucket(name, "tokens"), tokens, tpm)
            self.metrics.tenant_remaining_tokens.labels(name).set(state.remaining)

    async def _take(
        self, charge: Charge, rpm: BucketLimit | None, tpm: BucketLimit | None
    ) -> None:
        """Take the concurrency slot, one request and the worst case in tokens, all at once.
        Refused (concurrency first, then requests, then tokens, as the 429 says) or failed:
        what was taken is given back before the error goes on."""
        tenant, slot = charge.tenant, charge.slot
        name = tenant.name
        held, requests, tokens = await together(
            None if slot is None else self.store.try_acquire(
                slot.pool, slot.lease_id, 1, slot.limit, slot.ttl_s
            ),
            None if rpm is None else self.store.take(_bucket(name, "requests"), 1, rpm),
            None if tpm is None else self.store.take(
                _bucket(name, "tokens"), charge.reserved_tokens, tpm
            ),
        )  # fmt: skip
        if slot is not None and held is True:
            slot.held = True
        took_request = isinstance(requests, BucketState) and requests.allowed
        took_tokens = isinstance(tokens, BucketState) and tokens.allowed
        failure = next((r for r in (held, requests, tokens) if isinstance(r, BaseException)), None)
        refusal: OverBudget | None = None
        if failure is None and slot is not None and not slot.held:
            refusal = OverBudget(
                f"tenant {name!r} already has {slot.limit} requests in flight",
                limit="concurrency", retry_after_s=self._next_release_s(name, slot.limit),
            )
        elif failure is None and isinstance(requests, BucketState) and not requests.allowed:
            refusal = OverBudget(
                f"tenant {name!r} is over its {rpm and rpm.capacity} requests per minute",
                limit="requests", retry_after_s=requests.retry_after_s,
            )
        elif failure is None and isinstance(tokens, BucketState) and not tokens.allowed:
            refusal = OverBudget(
                f"tenant {name!r} is over its {tpm and tpm.capacity} tokens per minute: this "
                f"request may use {charge.reserved_tokens} and {max(0, tokens.remaining)} "
                "are left",
                limit="tokens", retry_after_s=tokens.retry_after_s,
            )
        if failure is None and refusal is None:
            if isinstance(tokens, BucketState):
                self.metrics.tenant_remaining_tokens.labels(name).set(tokens.remaining)
            self.metrics.tenant_tokens.labels(name, "reserved").inc(charge.reserved_tokens)
            charge.headers = rate_limit_headers(rpm, _state(requests), tpm, _state(tokens))
            return
        # give back what was taken; the 429 shows the buckets as they are then
        requests_back, tokens_back, _ = await together(
            self.store.put_back(_bucket(name, "requests"), 1, rpm) if rpm and took_request else None,
            self.store.put_back(
                _bucket(name, "tokens"), charge.reserved_tokens, tpm
            ) if tpm and took_tokens else None,
            self._free(charge),
        )  # fmt: skip
        if failure is not None:
            raise failure
        assert refusal is not None
        if refusal.type == "concurrency":
            refusal.headers.update(await self._current_headers(tenant))
        else:
            refusal.headers.update(rate_limit_headers(
                rpm, _state(requests_back) or _state(requests),
                tpm, _state(tokens_back) or _state(tokens),
            ))  # fmt: skip
        raise refusal

    async def _free(self, charge: Charge) -> None:
        """Give the concurrency slot back (once; a no-op when there is none or it is free)."""
        slot = charge.slot
        if slot is None or not slot.held:
            return
        slot.held = False
        if self.keeper is not None:
            self.keeper.discard(slot.pool, slot.lease_id)
        await self._release_lease(charge.tenant, slot.pool, slot.lease_id)

    def _observe_duration(self, tenant: str, seconds: float) -> None:
        mean = self._durations.get(tenant)
        self._durations[tenant] = seconds if mean is None else 0.8 * mean + 0.2 * seconds

    def _next_release_s(self, tenant: str, limit: int) -> float:
        """When one of `limit` requests in flight is likely to end: with requests lasting
        `d` on average and ending at random, one of `limit` ends every d / limit."""
        mean = self._durations.get(tenant)
        return 1.0 if mean is None else min(60.0, max(0.05, mean / limit))

    async def _current_headers(self, tenant: TenantConfig) -> dict[str, str]:
        """The x-ratelimit-* headers as the buckets stand, without taking anything."""
        tpm, rpm = _limits(tenant)
        try:
            requests = None if rpm is None else await self.store.peek(
                _bucket(tenant.name, "requests"), rpm
            )
            tokens = None if tpm is None else await self.store.peek(
                _bucket(tenant.name, "tokens"), tpm
            )
        except (StateStoreError, KvgateError):
            return {}
        return rate_limit_headers(rpm, requests, tpm, tokens)

    async def _release_lease(self, tenant: TenantConfig, pool: str, lease: str) -> None:
        try:
            await self.store.release(pool, lease)
        except (StateStoreError, KvgateError) as exc:
            log.warning("could not release %s's concurrency lease (expires by TTL): %s",
                        tenant.name, exc)


@contextlib.asynccontextmanager
async def _settling(charge: Charge) -> AsyncIterator[None]:
    """Settling happens as a request ends: a store failure then must not turn an answer the
    client already has into an error. The charge stays as reserved (the tenant pays the worst
    case for this request), which is logged."""
    try:
        yield
    except (StateStoreError, KvgateError) as exc:
        log.warning("could not settle tenant %s's charge: %s", charge.tenant.name, exc)


def _state(value: object) -> BucketState | None:
    return value if isinstance(value, BucketState) else None


def _limits(tenant: TenantConfig) -> tuple[BucketLimit | None, BucketLimit | None]:
    tpm = BucketLimit(tenant.tokens_per_minute) if tenant.tokens_per_minute else None
    rpm = BucketLimit(tenant.requests_per_minute) if tenant.requests_per_minute else None
    return tpm, rpm


def _bucket(tenant: str, kind: str) -> str:
    return f"budget:{tenant}:{kind}"


def rate_limit_headers(
    rpm: BucketLimit | None,
    requests: BucketState | None,
    tpm: BucketLimit | None,
    tokens: BucketState | None,
) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits a tenant has."""
    headers: dict[str, str] = {}
    for kind, limit, state in (("requests", rpm, requests), ("tokens", tpm, tokens)):
        if limit is None or state is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(limit.capacity)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, state.remaining))
        headers[f"x-ratelimit-reset-{kind}"] = _duration(state.reset_s)
    return headers


def _duration(seconds: float) -> str:
    """OpenAI's format: '1s', '6m0s', '20ms'."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
