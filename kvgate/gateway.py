"""The request path, top to bottom, and the services it calls.

    parse & validate → identify tenant → count tokens, bound worst case → choose pool
    → charge tenant budget → admit on a replica's ledger (or wait in the fair queue)
    → forward and stream back → settle: release blocks, correct the charge, record metrics

Each resource is held by an `async with`, so every ending — completion, upstream error,
timeout, client disconnect, cancellation — releases it exactly once.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from aiohttp import web

from kvgate.admission import Admission, Demand, Slot
from kvgate.catalog import Bound, Catalog, bound_worst_case, upstream_body
from kvgate.config import Config, TenantConfig
from kvgate.errors import NoReplica, NotFound, PayloadTooLarge
from kvgate.metrics import Metrics
from kvgate.replicas import Registry, Replica
from kvgate.requests import Endpoint, ParsedRequest, parse_body
from kvgate.routing.policies import LeastLoaded, RoutingPolicy
from kvgate.routing.pools import choose_pool, overflow_chain
from kvgate.state.base import StateStore
from kvgate.tenants import Budgets, Charge, Directory, check_access
from kvgate.tokens import Calibration, PromptCount
from kvgate.upstream import Outcome, Relay, upstream_headers

SESSION_HEADER = "X-Kvgate-Session"


@dataclass(frozen=True, slots=True)
class Runtime:
    """Everything derived from one version of the config. A request keeps the runtime it
    started with, so a reload never changes the rules under a request in flight."""

    config: Config
    directory: Directory


@dataclass(slots=True)
class RequestInfo:
    """Labels for the metrics of one request, filled in as the path learns them."""

    request_id: str
    started: float
    model: str = "unknown"
    pool: str = "none"
    tenant: str = "unknown"
    disconnected: bool = False


@dataclass(slots=True)
class Gateway:
    runtime: Runtime
    registry: Registry
    catalog: Catalog
    relay: Relay
    admission: Admission
    budgets: Budgets
    store: StateStore
    metrics: Metrics
    calibration: Calibration
    policy: RoutingPolicy = field(default_factory=LeastLoaded)

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        rt = self.runtime  # this request's config, whatever a reload does meanwhile
        info: RequestInfo = request[REQUEST_INFO]

        # parse & validate, identify the tenant
        raw = await read_body(request, rt.config.server.max_body_bytes)
        parsed = parse_body(raw, endpoint, request.headers.get(SESSION_HEADER))
        info.model = parsed.model
        tenant = rt.directory.identify(request.headers, request.remote)
        info.tenant = tenant.name
        check_access(tenant, parsed.model)
        self.require_model(rt, parsed.model)

        # count tokens, bound the worst case, choose the pool
        count = await self.catalog.count(parsed)
        prompt_tokens = self.calibration.apply(parsed.model, count.tokens)
        model = rt.config.model(parsed.model)
        sized = bound_worst_case(parsed, prompt_tokens, model, tenant, model.max_model_len)
        first_pool = choose_pool(rt.config.pools, sized.worst_tokens, tenant.pools)
        info.pool, candidates = self.candidates(rt, first_pool, parsed.model)
        bound = bound_worst_case(
            parsed, prompt_tokens, model, tenant,
            model.max_model_len or max_model_len(parsed.model, candidates),
        )
        demand = self.demand(info.pool, parsed.model, tenant, bound, count, rt.config)

        # charge the tenant, admit on a replica's ledger, forward; settle on every ending
        outcome = Outcome()
        max_hold_s = rt.config.timeouts.total_s + rt.config.admission.lease_ttl_s
        async with self.budgets.charge(
            tenant, bound.worst_tokens, max_hold_s + rt.config.admission.queue.max_wait_s
        ) as charge:
            try:
                async with self.admission.admit(demand, candidates) as slot:
                    return await self.forward(request, rt, parsed, bound, slot, charge, outcome)
            finally:
                await self.settle(charge, parsed, count.tokens, bound, outcome)

    def demand(
        self, pool: str, model: str, tenant: TenantConfig, bound: Bound, count: PromptCount,
        config: Config,
    ) -> Demand:
        return Demand(
            pool, model, bound.worst_tokens, tenant.name, tenant.priority,
            prefix_key=f"{model}:{count.prefix_key.hex()}" if count.prefix_key else None,
            # never credit more shared blocks than kvgate may have over-estimated
            prefix_tokens=int(count.prefix_tokens * min(1.0, self.calibration.ratio(model))),
            # the request runs at most total_s once forwarded; the lease TTL is the grace
            max_hold_s=config.timeouts.total_s + config.admission.lease_ttl_s,
        )

    async def forward(
        self,
        request: web.Request,
        rt: Runtime,
        parsed: ParsedRequest,
        bound: Bound,
        slot: Slot,
        charge: Charge,
        outcome: Outcome,
    ) -> web.StreamResponse:
        info: RequestInfo = request[REQUEST_INFO]
        replica = slot.replica
        replica.inflight[info.request_id] = lambda: bound.prompt_tokens + outcome.streamed_tokens
        headers = {
            **charge.headers,
            "X-Request-Id": info.request_id,
            "X-Kvgate-Pool": info.pool,
            "X-Kvgate-Replica": replica.id,
        }
        try:
            return await self.relay.forward(
                request,
                parsed.endpoint.value,
                upstream_body(parsed, bound),
                upstream_headers(
                    request.headers, info.request_id, replica,
                    drop_authorization=rt.config.auth.mode != "none",
                ),
                replica,
                headers,
                stream=parsed.stream,
                client_wants_usage=parsed.client_wants_usage,
                outcome=outcome,
            )
        finally:
            replica.inflight.pop(info.request_id, None)
            info.disconnected = outcome.client_disconnected
            self.observe(info, bound, slot, outcome)

    async def settle(
        self, charge: Charge, parsed: ParsedRequest, estimate: int, bound: Bound, outcome: Outcome
    ) -> None:
        """Correct the tenant's charge to what really happened; unsettled charges (nothing
        generated) are refunded whole when the budget's context exits."""
        if outcome.usage is not None:
            ratio = self.calibration.observe(parsed.model, estimate, outcome.usage.prompt_tokens)
            self.metrics.calibration.labels(parsed.model).set(ratio)
            await self.budgets.settle(
                charge, outcome.usage.prompt_tokens, outcome.usage.completion_tokens
            )
        elif outcome.streamed_tokens:
            await self.budgets.settle(charge, bound.prompt_tokens, outcome.streamed_tokens)

    def observe(self, info: RequestInfo, bound: Bound, slot: Slot, outcome: Outcome) -> None:
        if outcome.first_token_at is not None:
            self.metrics.ttft.labels(info.pool, info.model).observe(
                outcome.first_token_at - info.started
            )
        used = bound.prompt_tokens + outcome.completion_tokens()
        if outcome.usage is not None:
            used = outcome.usage.prompt_tokens + outcome.usage.completion_tokens
        block_size = slot.replica.block_size or 16
        if slot.worst_case_blocks > 0:
            self.metrics.efficiency.labels(info.pool).observe(
                min(1.0, math.ceil(used / block_size) / slot.worst_case_blocks)
            )

    def require_model(self, rt: Runtime, model: str) -> None:
        known = {m.name for m in rt.config.models}
        served = any(model in r.models for r in self.registry)
        if model not in known and not served:
            raise NotFound(f"the model {model!r} does not exist", code="model_not_found",
                           param="model")

    def candidates(self, rt: Runtime, first_pool: str, model: str) -> tuple[str, list[Replica]]:
        """The first pool along the overflow chain with a healthy replica serving `model`,
        and those replicas in the routing policy's order."""
        for pool in overflow_chain(rt.config.pools, first_pool):
            ready = [r for r in self.registry.in_pool(pool) if r.healthy and r.serves(model)]
            if ready:
                return pool, self.policy.order(ready, self.admission.reserved)
        raise NoReplica(f"no healthy replica in pool {first_pool!r} serves model {model!r}")


def max_model_len(model: str, candidates: list[Replica]) -> int | None:
    """The largest context any candidate reports for `model` (admission then skips replicas
    whose own limit is smaller)."""
    lengths = [n for r in candidates if (n := r.max_model_len(model)) is not None]
    return max(lengths) if lengths else None


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
    chunks = []
    size = 0
    async for chunk in request.content.iter_chunked(65536):
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


REQUEST_INFO = web.RequestKey("kvgate_request", RequestInfo)


def new_request_info(request: web.Request) -> RequestInfo:
    given = request.headers.get("X-Request-Id", "")
    request_id = given if 0 < len(given) <= 128 and given.isprintable() else os.urandom(16).hex()
    return RequestInfo(request_id=request_id, started=time.monotonic())
