"""Tenants: who is asking (API-key hash, or a trusted header), and their token budgets.

Budgets are charged in tokens, not requests: at admission a request is charged its worst case
(prompt + max_tokens) and one request; when it ends the charge is settled to what vLLM reports
it used (the unused part refunded, an undercount charged), and a request that failed before
its first token is refunded whole. Each step is one atomic state-store call (`charge`,
`settle`), so several kvgate instances on one Redis enforce one limit. A tenant's concurrent
requests are leases, so a crashed instance's count comes back by itself.

A tenant's names in the store share one name group, `tenant:<name>/...` (kvgate/state/base.py),
so one step can touch its concurrency pool and both buckets (one Redis Cluster slot).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from kvgate.admission.leases import LeaseKeeper
from kvgate.config import PRIORITY_CLASSES, AuthConfig, TenantConfig
from kvgate.errors import BadRequest, Forbidden, KvgateError, OverBudget, Unauthorized
from kvgate.metrics import Metrics
from kvgate.protect import acquire, finish
from kvgate.state.base import (
    BucketCorrection,
    BucketLimit,
    BucketState,
    BucketTake,
    Charged,
    LeaseHold,
    StateStore,
    StateStoreError,
)

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

    def fairness_lane(self, tenant: TenantConfig, fairness_id: str | None) -> str:
        """Whom a request of `tenant` shares the queue fairly among: its tenant, or where
        kvgate knows no one by a credential (no auth, or the anonymous tenant) and the
        gateway names a flow (`x-gateway-inference-fairness-id`), that flow. An identified
        tenant is one lane whatever it sends: splitting into flows would outweigh others."""
        anonymous = self.auth.mode == "none" or tenant.name == self.auth.anonymous_tenant
        if not anonymous or not fairness_id:
            return tenant.name
        return f"{tenant.name}/{fairness_id}"

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


# The Gateway API Inference Extension's names for the objective a request is served under,
# and for the flow it shares fairly with.
OBJECTIVE = "x-gateway-inference-objective"
FAIRNESS_ID = "x-gateway-inference-fairness-id"


def under_objective(
    tenant: TenantConfig, objective: str | None, objectives: Mapping[str, str]
) -> TenantConfig:
    """The tenant as its request runs under `objective`: in the lower of the tenant's class
    and the objective's (`objectives`: each name's class); an objective not configured
    changes nothing."""
    wanted = objectives.get(objective) if objective else None
    if wanted is None:
        return tenant
    if PRIORITY_CLASSES.index(wanted) <= PRIORITY_CLASSES.index(tenant.priority):
        return tenant
    return tenant.model_copy(update={"priority": wanted})


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
    """One of a tenant's `max_concurrent` requests: a lease in `tenant:<name>/concurrency`."""

    lease: LeaseHold
    held: bool = False


class Budgets:
    """Charges and settles tenants' budgets in `store`.

    A tenant's concurrent requests are leases in `tenant:<name>/concurrency`. With a `keeper`
    (the one that renews the ledger's leases) they last `keeper.ttl_s` and are renewed while
    the request runs, so a killed instance's count comes back within that TTL; without one
    they last CONCURRENCY_TTL_S unrenewed (a request running longer than that stops counting).

    Store calls: a charge — the concurrency lease, one request and the worst case in
    tokens — is one composite step that holds all three or nothing, so a refusal leaves nothing
    to give back; settling (the token correction and the lease's release) is one more, and so
    is giving everything back when the request never ran.
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
            charge.slot = ConcurrencySlot(LeaseHold(
                tenant_key(tenant.name, "concurrency"), os.urandom(12).hex(), 1,
                tenant.max_concurrent, ttl_s,
            ))  # fmt: skip

        async def give_all_back(_: None = None) -> None:
            await self._settle(charge, refund=worst_tokens)

        started = time.monotonic()
        await acquire(self._take(charge, rpm, tpm), give_all_back)
        slot = charge.slot
        if slot is not None and self.keeper is not None:
            self.keeper.add(
                slot.lease.pool, slot.lease.lease_id, max_age_s=max_hold_s,
                on_stale=lambda: self._free(charge), kind="concurrency", ttl_s=slot.lease.ttl_s,
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
                await finish(self._free(charge))  # settled: freed already, unless dropped

    async def settle(self, charge: Charge, prompt_tokens: int, completion_tokens: int) -> None:
        """Correct the charge to actual usage (refund the unused part or charge the excess)
        and free the tenant's concurrency slot, in one store call: the request is over. Runs
        to its end whatever cancellation arrives meanwhile."""
        if charge.settled:
            return
        charge.settled = True
        name = charge.tenant.name
        self.metrics.tenant_tokens.labels(name, "prompt").inc(prompt_tokens)
        self.metrics.tenant_tokens.labels(name, "completion").inc(completion_tokens)
        await finish(self._settle(
            charge, refund=charge.reserved_tokens - (prompt_tokens + completion_tokens)
        ))  # fmt: skip

    async def _settle(self, charge: Charge, refund: int) -> None:
        """One store call: put back `refund` tokens (take -refund by force when negative:
        the request used more than reserved) and release the concurrency lease. A store
        failure then must not turn an answer the client already has into an error: the
        charge stays as reserved (the tenant pays the worst case for this request) and the
        lease expires by its TTL, which is logged."""
        tpm, _ = _limits(charge.tenant)
        name = charge.tenant.name
        if refund > 0:
            self.metrics.tenant_tokens.labels(name, "refunded").inc(refund)
        corrections = []
        if tpm is not None and refund != 0:
            corrections.append(BucketCorrection(tenant_key(name, "tokens"), refund, tpm))
        release = self._let_go(charge)
        if release is None and not corrections:
            return
        try:
            settled = await self.store.settle(release, corrections)
        except (StateStoreError, KvgateError) as exc:
            log.warning("could not settle tenant %s's charge (it stays as reserved; the "
                        "concurrency lease expires by TTL): %s", name, exc)
            return
        if settled.buckets:
            self.metrics.tenant_remaining_tokens.labels(name).set(settled.buckets[0].remaining)

    async def _take(
        self, charge: Charge, rpm: BucketLimit | None, tpm: BucketLimit | None
    ) -> None:
        """Take the concurrency slot, one request and the worst case in tokens: all of them
        in one store call, or none. Refused: the first to refuse, in the order concurrency,
        requests, tokens, is the 429, whose headers show the buckets untouched."""
        tenant, slot = charge.tenant, charge.slot
        name = tenant.name
        takes = []
        if rpm is not None:
            takes.append(BucketTake(tenant_key(name, "requests"), 1, rpm))
        if tpm is not None:
            takes.append(BucketTake(tenant_key(name, "tokens"), charge.reserved_tokens, tpm))
        lease = None if slot is None else slot.lease
        charged = (
            await self.store.charge(lease, takes) if lease or takes else Charged(True, ())
        )
        states = iter(charged.buckets)
        requests = None if rpm is None else next(states)
        tokens = None if tpm is None else next(states)
        headers = rate_limit_headers(rpm, requests, tpm, tokens)
        if charged.granted:
            if slot is not None:
                slot.held = True
            if tokens is not None:
                self.metrics.tenant_remaining_tokens.labels(name).set(tokens.remaining)
            self.metrics.tenant_tokens.labels(name, "reserved").inc(charge.reserved_tokens)
            charge.headers = headers
            return
        if slot is not None and not charged.lease_fits:
            refusal = OverBudget(
                f"tenant {name!r} already has {slot.lease.limit} requests in flight",
                limit="concurrency",
                retry_after_s=self._next_release_s(name, slot.lease.limit),
            )
        elif requests is not None and not requests.allowed:
            refusal = OverBudget(
                f"tenant {name!r} is over its {rpm and rpm.capacity} requests per minute",
                limit="requests", retry_after_s=requests.retry_after_s,
            )
        else:
            assert tokens is not None and not tokens.allowed
            refusal = OverBudget(
                f"tenant {name!r} is over its {tpm and tpm.capacity} tokens per minute: this "
                f"request may use {charge.reserved_tokens} and {max(0, tokens.remaining)} "
                "are left",
                limit="tokens", retry_after_s=tokens.retry_after_s,
            )
        refusal.headers.update(headers)
        raise refusal

    def _let_go(self, charge: Charge) -> LeaseHold | None:
        """The concurrency lease to release, once: None when there is none or it is free
        already (the keeper stops renewing it here)."""
        slot = charge.slot
        if slot is None or not slot.held:
            return None
        slot.held = False
        if self.keeper is not None:
            self.keeper.discard(slot.lease.pool, slot.lease.lease_id)
        return slot.lease

    async def _free(self, charge: Charge) -> None:
        """Give the concurrency slot back alone (a lease the keeper found stale)."""
        lease = self._let_go(charge)
        if lease is None:
            return
        try:
            await self.store.release(lease.pool, lease.lease_id)
        except (StateStoreError, KvgateError) as exc:
            log.warning("could not release %s's concurrency lease (expires by TTL): %s",
                        charge.tenant.name, exc)

    def _observe_duration(self, tenant: str, seconds: float) -> None:
        mean = self._durations.get(tenant)
        self._durations[tenant] = seconds if mean is None else 0.8 * mean + 0.2 * seconds

    def _next_release_s(self, tenant: str, limit: int) -> float:
        """When one of `limit` requests in flight is likely to end: with requests lasting
        `d` on average and ending at random, one of `limit` ends every d / limit."""
        mean = self._durations.get(tenant)
        return 1.0 if mean is None else min(60.0, max(0.05, mean / limit))


def _limits(tenant: TenantConfig) -> tuple[BucketLimit | None, BucketLimit | None]:
    return _bucket_limits(tenant.tokens_per_minute, tenant.requests_per_minute)


@functools.lru_cache(maxsize=1024)
def _bucket_limits(
    tokens_per_minute: int | None, requests_per_minute: int | None
) -> tuple[BucketLimit | None, BucketLimit | None]:
    """(tokens, requests) per minute as buckets; the same few pairs request after request."""
    tpm = BucketLimit(tokens_per_minute) if tokens_per_minute else None
    rpm = BucketLimit(requests_per_minute) if requests_per_minute else None
    return tpm, rpm


def tenant_key(tenant: str, kind: str) -> str:
    """A tenant's pool or bucket in the state store: `concurrency`, `requests` or `tokens`,
    all in the tenant's name group, so one step can take them together."""
    return f"tenant:{tenant}/{kind}"


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
