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

from kvgate.admission import Admission
from kvgate.calibration import Calibration, Terms
from kvgate.catalog import Bound, Catalog, bound_worst_case, upstream_body
from kvgate.config import Config, ModelConfig, TenantConfig
from kvgate.demand import Demand, Slot
from kvgate.errors import NoReplica, NotFound, PayloadTooLarge
from kvgate.metrics import Metrics
from kvgate.normalize.stage import PromptStage
from kvgate.prediction import OutputPredictor
from kvgate.replicas import Registry, Replica
from kvgate.requests import Endpoint, ParsedRequest, parse_body
from kvgate.routing.policies import LeastLoaded, RoutingPolicy
from kvgate.routing.pools import choose_pool, overflow_chain
from kvgate.state.base import StateStore
from kvgate.tenants import Budgets, Charge, Directory, check_access
from kvgate.tokens import PromptCount
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

    request_id: str  # the client's X-Request-Id if it sent a sane one, echoed and forwarded
    started: float
    key: str  # kvgate's own id for the request: clients may send the same X-Request-Id twice
    model: str = "unknown"
    pool: str = "none"
    tenant: str = "unknown"
    disconnected: bool = False  # the client left before it had the whole answer
    delivered: bool = False  # the client was sent the whole answer
    replica: str | None = None
    prompt_tokens: int | None = None  # kvgate's estimate of vLLM's count
    reserved_blocks: int | None = None
    charged_tokens: int | None = None  # what the tenant paid in the end
    fingerprint: str | None = None  # the normalized prefix's (tools + system prompt)


@dataclass(slots=True)
class Gateway:
    runtime: Runtime
    registry: Registry
    catalog: Catalog
    relay: Relay
    admission: Admission
    budgets: Budgets
    prompts: PromptStage  # normalization, fingerprints, drift
    store: StateStore
    metrics: Metrics
    calibration: Calibration
    predictor: OutputPredictor = field(default_factory=OutputPredictor)
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

        # normalize the prompt: counted, fingerprinted and forwarded as normalized
        parsed, fingerprint = self.prompts.apply(parsed, tenant, rt.config)
        info.fingerprint = fingerprint  # the prefix-affinity key

        # count tokens, bound the worst case, choose the pool
        count = await self.catalog.count(parsed)
        terms = self.terms(parsed, count)  # what vLLM will count, from what kvgate counted
        model = rt.config.model(parsed.model)
        sized = self.bound(parsed, count, terms, tenant, model, model.max_model_len)
        first_pool = choose_pool(rt.config.pools, sized.worst_tokens, tenant.pools)
        info.pool, candidates = self.candidates(rt, first_pool, parsed.model)
        bound = self.bound(
            parsed, count, terms, tenant, model,
            model.max_model_len or max_model_len(parsed.model, candidates),
        )
        info.prompt_tokens = bound.prompt_tokens
        demand = self.demand(info.pool, parsed, tenant, bound, count, terms, rt.config)

        # charge the tenant, admit on a replica's ledger, forward; settle on every ending
        outcome = Outcome()
        held_at_most = rt.config.admission.queue.max_wait_s + (demand.max_hold_s or 0.0)
        async with self.budgets.charge(tenant, bound.worst_tokens, held_at_most) as charge:
            try:
                async with self.admission.admit(demand, candidates) as slot:
                    info.reserved_blocks, info.replica = slot.reserved_blocks, slot.replica.id
                    slot.progress = lambda: bound.prompt_tokens + processed_tokens(
                        parsed, bound, outcome
                    )
                    return await self.forward(request, rt, parsed, bound, slot, charge, outcome)
            finally:
                await self.settle(charge, parsed, count, bound, outcome, info)

    def bound(
        self,
        parsed: ParsedRequest,
        count: PromptCount,
        terms: Terms,
        tenant: TenantConfig,
        model: ModelConfig,
        max_model_len: int | None,
    ) -> Bound:
        """The worst case, from the prompt tokens vLLM is expected to count."""
        media = count.media_tokens
        return bound_worst_case(
            parsed, terms.estimate(count.features) + media, model, tenant, max_model_len,
            prompts=count.features.prompts,
            longest_prompt=terms.estimate(count.longest or count.features) + media,
        )

    def terms(self, parsed: ParsedRequest, count: PromptCount) -> Terms:
        prior = self.catalog.prior(parsed.model, parsed.endpoint, count)
        return self.calibration.terms(parsed.model, fit_name(parsed, count), prior)

    def demand(
        self, pool: str, parsed: ParsedRequest, tenant: TenantConfig, bound: Bound,
        count: PromptCount, terms: Terms, config: Config,
    ) -> Demand:
        model = parsed.model
        # never credit more shared blocks than the text alone could hold
        prefix = Terms(min(1.0, terms.ratio), terms.per_message).estimate(count.prefix)
        return Demand(
            pool, model, bound.worst_tokens, tenant.name, tenant.priority,
            prompt_tokens=bound.prompt_tokens * parsed.sequences,
            prefix_key=f"{model}:{count.prefix_key.hex()}" if count.prefix_key else None,
            prefix_tokens=prefix if count.prefix_key else 0,
            # the request runs at most total_s once forwarded; the lease TTL is the grace
            max_hold_s=config.timeouts.total_s + config.admission.lease_ttl_s,
            ahead_tokens=self.ahead_tokens(parsed, tenant, bound, config),
        )

    def ahead_tokens(
        self, parsed: ParsedRequest, tenant: TenantConfig, bound: Bound, config: Config
    ) -> int | None:
        """In predicted mode, once this tenant's (or this model's) answers are known: how far
        ahead of what it has written the request's reservation stays — the likely answer,
        at most the lookahead — over all its sequences. None: reserve the worst case."""
        admission = config.admission
        mode = tenant.admission_mode or admission.class_modes.get(tenant.priority, admission.mode)
        if mode != "predicted":
            return None
        likely = self.predictor.predict(tenant.name, parsed.model, bound.max_tokens)
        if likely is None:
            return None
        return min(likely, admission.lookahead_tokens) * bound.prompts * parsed.sequences

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
        outcome.token_rate = replica.token_rate
        if slot.progress is not None:
            replica.inflight[info.key] = slot.progress
        headers = {
            **charge.headers,
            "X-Request-Id": info.request_id,
            "X-Kvgate-Pool": info.pool,
            "X-Kvgate-Replica": replica.id,
        }
        if rt.config.server.accounting_headers:
            headers["X-Kvgate-Prompt-Tokens"] = str(bound.prompt_tokens)
            headers["X-Kvgate-Reserved-Blocks"] = str(slot.reserved_blocks)
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
            replica.inflight.pop(info.key, None)
            info.disconnected = outcome.client_disconnected and not outcome.done
            info.delivered = outcome.done
            self.observe(info, parsed, bound, slot, outcome)

    async def settle(
        self,
        charge: Charge,
        parsed: ParsedRequest,
        count: PromptCount,
        bound: Bound,
        outcome: Outcome,
        info: RequestInfo,
    ) -> None:
        """Correct the tenant's charge to what the replica processed; unsettled charges
        (nothing reached the replica) are refunded whole when the budget's context exits."""
        usage = outcome.usage
        if usage is not None:
            # an image's true cost, or a prompt vLLM truncated, would only skew the text's fit
            if not count.media_tokens and parsed.body.get("truncate_prompt_tokens") is None:
                prior = self.catalog.prior(parsed.model, parsed.endpoint, count)
                endpoint = fit_name(parsed, count)
                self.calibration.observe(
                    parsed.model, endpoint, count.features, usage.prompt_tokens, prior
                )
                self.export_calibration(parsed.model, endpoint)
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
            if outcome.done and not outcome.upstream_failed:
                sequences = bound.prompts * parsed.sequences
                self.predictor.observe(info.tenant, parsed.model, completion // sequences)
        elif (
            outcome.sent_at is None  # never sent
            or outcome.unreachable  # the connection failed: the replica never had it
            or outcome.status >= 400  # refused by the replica
            or (outcome.upstream_failed and outcome.status == 0 and parsed.stream)
        ):
            # nothing processed that the tenant caused (a stream that never began: vLLM sends
            # the headers at once, so the replica was not working on it): refunded on exit
            return
        else:
            # the client left, the stream broke, or kvgate gave up waiting for a whole answer
            # the replica was still computing: what the replica processed so far
            prompt, completion = bound.prompt_tokens, processed_tokens(parsed, bound, outcome)
        info.charged_tokens = prompt + completion
        await self.budgets.settle(charge, prompt, completion)

    def export_calibration(self, model: str, endpoint: str) -> None:
        m, calibration = self.metrics, self.calibration
        m.calibration.labels(model).set(calibration.ratio(model))
        terms = calibration.terms(model, endpoint, Terms())
        for name, value in zip(("ratio", "per_message", "per_request"), terms.vector(), strict=True):
            m.calibration_terms.labels(model, endpoint, name).set(value)
        error = calibration.error(model, endpoint)
        if error is not None:
            m.token_estimate_error.labels(model, endpoint).set(error)

    def observe(
        self, info: RequestInfo, parsed: ParsedRequest, bound: Bound, slot: Slot, outcome: Outcome
    ) -> None:
        now = time.monotonic()
        if outcome.first_token_at is not None:
            self.metrics.ttft.labels(info.pool, info.model).observe(
                outcome.first_token_at - info.started
            )
        if outcome.usage is not None and outcome.sent_at is not None:
            # one sequence's pace here: from the first token for streams, from sending for
            # whole answers (which then includes the prefill: a slightly low rate)
            per_sequence = outcome.usage.completion_tokens // (bound.prompts * parsed.sequences)
            since = outcome.first_token_at if parsed.stream else outcome.sent_at
            if since is not None:
                slot.replica.observe_rate(per_sequence, now - since)
        used = bound.prompt_tokens + outcome.completion_tokens()
        if outcome.usage is not None:
            used = outcome.usage.prompt_tokens + outcome.usage.completion_tokens
        block_size = slot.replica.block_size or 16
        if slot.reserved_blocks > 0:
            self.metrics.efficiency.labels(info.pool).observe(
                min(1.0, math.ceil(used / block_size) / slot.reserved_blocks)
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


def fit_name(parsed: ParsedRequest, count: PromptCount) -> str:
    """Which calibration fit a request belongs to: per endpoint, and apart for chats counted
    with the model's own template (their features mean something else)."""
    name = parsed.endpoint.name.lower()
    return f"{name}+template" if count.templated else name


def processed_tokens(parsed: ParsedRequest, bound: Bound, outcome: Outcome) -> int:
    """Output tokens a replica computed for a request that ended without reporting usage.

    Streamed: the chunks relayed. Not streamed (the client gave up, or the call failed
    midway): the time the replica had at its recent pace per sequence, within max_tokens —
    what it spent on the request, so that timing out cannot beat the budget. Until the
    replica's pace is known, the whole reservation is charged.
    """
    if parsed.stream or outcome.sent_at is None:
        return outcome.streamed_tokens
    sequences = bound.prompts * parsed.sequences
    if outcome.token_rate is None:
        return bound.max_tokens * sequences
    elapsed = time.monotonic() - outcome.sent_at
    return min(bound.max_tokens, math.ceil(outcome.token_rate * elapsed)) * sequences


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
    key = os.urandom(16).hex()
    given = request.headers.get("X-Request-Id", "")
    request_id = given if 0 < len(given) <= 128 and given.isprintable() else key
    return RequestInfo(request_id=request_id, started=time.monotonic(), key=key)
