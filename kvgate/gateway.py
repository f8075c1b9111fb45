"""The request path, top to bottom, and the services it calls.

    parse & validate → identify tenant → count tokens, bound worst case → choose pool
    → charge tenant budget → rank replicas (router) → admit on the first one's ledger with
    room (or wait in the fair queue, ranked again each attempt) → forward and stream back
    (once more elsewhere if the replica failed before any byte reached the client; placed
    again, elsewhere or from the queue, if its vLLM refused it as busy)
    → settle: release blocks, correct the charge, record metrics

Each resource is held by an `async with`, so every ending — completion, upstream error,
timeout, client disconnect, cancellation — releases it exactly once. Every stage reads the
request's own config snapshot, `rt` (`kvgate.runtime`), taken when the request starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from kvgate.admission import Admission, Ranker
from kvgate.calibration import Calibration, Observed, Terms
from kvgate.catalog import Bound, bound_worst_case, context_limit, upstream_payload
from kvgate.config import Config, CurrentConfig, ModelConfig, TenantConfig
from kvgate.demand import Demand, Slot
from kvgate.errors import (
    NeverFits,
    NoReplica,
    NotFound,
    RateLimited,
    ReplicaBusy,
    ServerError,
)
from kvgate.metrics import Metrics
from kvgate.normalize.stage import PromptStage
from kvgate.prediction import OutputPredictor
from kvgate.progress import processed_tokens, written_tokens
from kvgate.protect import begin, finish
from kvgate.replicas import Registry, Writing
from kvgate.requests import Endpoint, ParsedRequest, parse_request, read_body
from kvgate.routing.failover import replica_failed, retry_reason, trial_gate
from kvgate.routing.fleet import Fleet
from kvgate.routing.health import Breakers
from kvgate.routing.pools import choose_pool, overflow_chain
from kvgate.routing.route import Route
from kvgate.routing.router import Ranking, Router
from kvgate.routing.sessions import Sessions, session_key
from kvgate.runtime import Runtime
from kvgate.state.base import StateStore
from kvgate.tenants import Budgets, Charge, check_access
from kvgate.tokens import PromptCount
from kvgate.upstream import Outcome, Relay, upstream_headers

# How long a request's arrival snapshot of the fleet may serve its first ranking.
FLEET_REUSE_S = 0.002


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
    max_tokens: int | None = None  # per sequence, as bounded
    worst_case_blocks: int | None = None
    queue_wait_s: float | None = None  # time waiting for KV capacity, when admitted
    ttft_s: float | None = None  # arrival to the first streamed token
    fingerprint: str | None = None  # the normalized prefix's (tools + system prompt)


@dataclass(slots=True)
class Gateway:
    runtime: Runtime  # in force now: a request takes it at its start; a reload replaces it
    # `runtime.config`, read when asked: the one way background stages read the config
    current: CurrentConfig
    registry: Registry
    relay: Relay
    admission: Admission
    budgets: Budgets
    prompts: PromptStage  # normalization, fingerprints, drift
    store: StateStore
    metrics: Metrics
    calibration: Calibration
    router: Router
    sessions: Sessions
    breakers: Breakers
    predictor: OutputPredictor = field(default_factory=OutputPredictor)

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        rt = self.runtime  # this request's config, whatever a reload does meanwhile
        info: RequestInfo = request[REQUEST_INFO]

        # parse & validate, identify the tenant
        raw = await read_body(
            request, rt.config.server.max_body_bytes, rt.config.server.client_timeout_s
        )
        parsed = await parse_request(raw, endpoint, rt.config.server.max_messages)
        info.model = parsed.model
        tenant = rt.directory.identify(request.headers, request.remote)
        info.tenant = tenant.name
        check_access(tenant, parsed.model)
        self.require_model(rt, parsed.model)

        # normalize the prompt: counted, fingerprinted and forwarded as normalized
        as_sent = parsed
        parsed, fingerprint = self.prompts.apply(parsed, tenant, rt.config)
        info.fingerprint = fingerprint  # the prefix-affinity key

        # count tokens, bound the worst case, choose the pool
        count = await rt.catalog.count(parsed)
        terms = self.terms(rt, parsed, count)  # what vLLM will count, from what kvgate counted
        model = rt.config.model(parsed.model)
        sized = self.bound(parsed, count, terms, tenant, model, model.max_model_len)
        first_pool = choose_pool(rt.config.pools, sized.worst_tokens, tenant.pools)
        fleet = self.fleet(rt.config)
        info.pool = self.router.pool(
            parsed.model, overflow_chain(rt.config.pools, first_pool), fleet
        )
        bound = self.bound(
            parsed, count, terms, tenant, model,
            context_limit(model.max_model_len, fleet.max_model_len(parsed.model, info.pool)),
        )
        info.prompt_tokens, info.max_tokens = bound.prompt_tokens, bound.max_tokens
        demand = self.demand(info.pool, parsed, tenant, bound, count, terms, rt.config)
        route = Route(
            demand, session_key(parsed, request.headers, rt.config.routing.sessions, tenant.name),
            # the normalized system prompt and tools; else the first message's text
            prefix=fingerprint or demand.prefix_key,
        )

        # charge the tenant, then admit, forward and settle on every ending
        outcomes = [Outcome()]  # one per attempt; the last one is what the tenant pays for
        attempts = 1 + rt.config.routing.retry.attempts
        held_at_most = attempts * (rt.config.admission.queue.max_wait_s + (demand.max_hold_s or 0.0))
        async with self.budgets.charge(tenant, bound.worst_tokens, held_at_most) as charge:
            settling: list[asyncio.Future[None]] = []

            def settle_now() -> None:  # the answer is complete: settle beside the release
                settling.append(
                    begin(self.settle(rt, charge, parsed, count, bound, outcomes[-1], info))
                )

            try:
                return await self.serve(
                    request, rt, parsed, bound, route, charge, outcomes,
                    arrival=fleet,
                    payload=upstream_payload(parsed, bound, raw if parsed is as_sent else None),
                    settle_now=settle_now,
                )
            finally:
                if settling:
                    await finish(settling[0])
                else:
                    await self.settle(rt, charge, parsed, count, bound, outcomes[-1], info)

    async def serve(
        self,
        request: web.Request,
        rt: Runtime,
        parsed: ParsedRequest,
        bound: Bound,
        route: Route,
        charge: Charge,
        outcomes: list[Outcome],
        *,
        payload: bytes,
        arrival: Fleet | None = None,
        settle_now: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """Admit on the router's best replica with room and forward. If that replica fails
        before any byte reached the client, release it and go once more elsewhere (the
        blocks are reserved again there; the tenant is charged once). If its vLLM refused it
        as busy (backpressure, not a failure), place it again, on another replica or from the
        queue, within what is left of its wait budget. Each attempt appends its `Outcome`, and
        the last is what the tenant pays for."""
        info: RequestInfo = request[REQUEST_INFO]
        failed: ServerError | None = None
        failures = 0
        since: float | None = None  # when it first asked for admission, once sent back as busy
        try:
            while True:
                outcome = outcomes[-1]
                ranked: list[Ranking] = []
                asked = time.monotonic()
                try:
                    ranker = self.ranker(route, rt, ranked, info.key, arrival)
                    arrival = None  # a retry ranks afresh
                    async with self.admission.admit(
                        route.demand, ranker, rt.config.admission, since
                    ) as slot:
                        info.reserved_blocks, info.replica = slot.reserved_blocks, slot.replica.id
                        info.worst_case_blocks, info.queue_wait_s = slot.worst_blocks, slot.queued_s
                        self.count_prefix_route(route, rt, slot, ranked)
                        slot.progress = written_tokens(parsed, bound, outcome, slot.replica)
                        demand = route.demand
                        writing = Writing(slot.progress, demand.prefix_key, demand.prefix_tokens)
                        response = await self.forward(
                            request, rt, parsed, bound, slot, charge, outcome, writing, payload
                        )
                        if 0 < outcome.status < 500:  # the replica served it: bind the session
                            await self.bind_session(route, rt, slot, ranked)
                        if settle_now is not None:
                            # its store calls start now, so the release on leaving the block
                            # goes in the same round trip (issue 14)
                            settle_now()
                        return response
                except ReplicaBusy:
                    # the busy replica takes no more for now (Admission.refused_busy): the
                    # request goes elsewhere, or waits for room, on its first wait budget
                    since = asked if since is None else since
                    failed = None  # a 429 in time beats an earlier replica's failure
                    outcomes.append(Outcome())
                except (NoReplica, NeverFits, RateLimited):
                    if failed is not None:  # nowhere else to go: the replica's failure stands
                        raise failed from None
                    raise
                except ServerError as exc:
                    reason = retry_reason(exc, outcome, rt.config.routing.retry)
                    if reason is None or failures >= rt.config.routing.retry.attempts:
                        raise
                    assert info.replica is not None  # the failed attempt was admitted there
                    self.metrics.upstream_retries.labels(info.pool, reason).inc()
                    route = dataclasses.replace(route, exclude=route.exclude | {info.replica})
                    failed, failures = exc, failures + 1
                    outcomes.append(Outcome())
        finally:
            self.breakers.release(info.key)

    def ranker(
        self, route: Route, rt: Runtime, ranked: list[Ranking], holder: str,
        arrival: Fleet | None = None,
    ) -> Ranker:
        """Ranks replicas for `route` against a fresh fleet snapshot on every call (a
        half-open replica only for the request holding its trial; the first call may use the
        request's `arrival` snapshot while it is current); keeps the last ranking in `ranked`
        for the metrics of where the request ran."""

        async def rank(waited_s: float) -> Ranking:
            nonlocal arrival
            if arrival is not None and self.still_current(arrival):
                fleet = arrival
            else:
                fleet = self.fleet(rt.config)
            arrival = None
            ranking = await self.router.rank(route, fleet, rt.config.routing)
            ranking = trial_gate(ranking, self.breakers, holder)
            ranked[:] = [ranking]
            return ranking

        return rank

    def count_prefix_route(
        self, route: Route, rt: Runtime, slot: Slot, ranked: list[Ranking]
    ) -> None:
        """The request was admitted on `slot.replica`: did its prefix get its replica?"""
        if route.prefix is not None and "prefix_affinity" in rt.config.routing.scorers:
            favourite = ranked[0].favourites.get("prefix_affinity") if ranked else None
            where = "preferred" if favourite == slot.replica.id else "elsewhere"
            self.metrics.prefix_routes.labels(route.demand.pool, where).inc()

    async def bind_session(
        self, route: Route, rt: Runtime, slot: Slot, ranked: list[Ranking]
    ) -> None:
        """The replica served the request: the session is bound there from now on."""
        if route.session_key is not None and "session" in rt.config.routing.scorers and ranked:
            await self.sessions.ran_on(
                route.session_key, slot.replica.id, ranked[0].fleet, rt.config.routing.sessions
            )

    def fleet(self, config: Config) -> Fleet:
        """The fleet as it is now, under `config` (a request's own, or the one in force): one
        snapshot for routing, gauges and the admin view."""
        return self.admission.snapshot(self.registry, config, circuit=self.breakers.state)

    def still_current(self, fleet: Fleet) -> bool:
        """A request's arrival snapshot is good for its first ranking while it is fresh and
        no reservation moved since (issue 14: three snapshots per request were 4% of the CPU;
        within FLEET_REUSE_S health and circuits change no more than between rank and send)."""
        if time.monotonic() - fleet.taken_at > FLEET_REUSE_S:
            return False
        reserved = self.admission.reserved
        return all(v.reserved_blocks == reserved.get(v.id, 0) for v in fleet)

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

    def terms(self, rt: Runtime, parsed: ParsedRequest, count: PromptCount) -> Terms:
        prior = rt.catalog.prior(parsed.model, parsed.endpoint, count)
        endpoint = count.fit_name(parsed.endpoint.name.lower())
        terms = self.calibration.terms(parsed.model, endpoint, prior, rt.config.calibration)
        if terms.floored(count.features):  # the fit would have counted it short: raw count won
            self.metrics.calibration_floored.labels(parsed.model, endpoint).inc()
        return terms

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
        writing: Writing,
        payload: bytes,
    ) -> web.StreamResponse:
        info: RequestInfo = request[REQUEST_INFO]
        replica = slot.replica
        outcome.token_rate = replica.token_rate
        replica.inflight[info.key] = writing
        headers = {
            **charge.headers,
            "X-Request-Id": info.request_id,
            "X-Kvgate-Pool": info.pool,
            "X-Kvgate-Replica": replica.id,
        }
        if rt.config.server.accounting_headers:
            headers["X-Kvgate-Prompt-Tokens"] = str(bound.prompt_tokens)
            headers["X-Kvgate-Reserved-Blocks"] = str(slot.reserved_blocks)
        outcome.on_answer = lambda status: self.breakers.judge(
            replica.id, False if status < 400 else None, info.key
        )  # a trial is judged by its status, not held open while its answer streams
        try:
            return await self.relay.forward(
                request,
                parsed.endpoint.value,
                payload,  # the client's bytes, or its body as kvgate edited it
                upstream_headers(
                    request.headers, info.request_id, replica,
                    drop_authorization=rt.config.auth.mode != "none",
                ),
                replica,
                headers,
                stream=parsed.stream,
                client_wants_usage=parsed.client_wants_usage,
                outcome=outcome,
                timeouts=rt.config.timeouts,
            )
        finally:
            replica.inflight.pop(info.key, None)
            self.breakers.judge(replica.id, replica_failed(outcome, parsed.stream), info.key)
            if outcome.busy is not None:  # before the slot goes: it is counted as held there
                self.admission.refused_busy(slot, outcome.busy, rt.config.admission)
            info.disconnected = outcome.client_disconnected and not outcome.done
            info.delivered = outcome.done
            self.observe(info, parsed, bound, slot, outcome)

    async def settle(
        self,
        rt: Runtime,
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
                prior = rt.catalog.prior(parsed.model, parsed.endpoint, count)
                endpoint = count.fit_name(parsed.endpoint.name.lower())
                limits = rt.config.calibration
                observed = self.calibration.observe(
                    parsed.model, endpoint, count.features, usage.prompt_tokens, prior, limits
                )  # its gauges follow once a second (app.calibration_gauges)
                if observed is Observed.OUTLIER:
                    self.metrics.calibration_outliers.labels(parsed.model, endpoint).inc()
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

    def observe(
        self, info: RequestInfo, parsed: ParsedRequest, bound: Bound, slot: Slot, outcome: Outcome
    ) -> None:
        now = time.monotonic()
        if outcome.first_token_at is not None:
            info.ttft_s = outcome.first_token_at - info.started
            self.metrics.ttft.labels(info.pool, info.model).observe(info.ttft_s)
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
        block_size = slot.replica.kv_block_size
        if slot.reserved_blocks > 0:
            self.metrics.efficiency.labels(info.pool).observe(
                min(1.0, math.ceil(used / block_size) / slot.reserved_blocks)
            )

    def require_model(self, rt: Runtime, model: str) -> None:
        known = any(m.name == model for m in rt.config.models)
        if not known and not any(model in r.models for r in self.registry):
            raise NotFound(f"the model {model!r} does not exist", code="model_not_found",
                           param="model")


REQUEST_INFO = web.RequestKey("kvgate_request", RequestInfo)
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def new_request_info(request: web.Request) -> RequestInfo:
    key = os.urandom(16).hex()
    given = request.headers.get("X-Request-Id", "")
    # echoed in a response header: visible ASCII only, nothing a header could be split on
    request_id = given if 0 < len(given) <= 128 and _VISIBLE_ASCII.fullmatch(given) else key
    return RequestInfo(request_id=request_id, started=time.monotonic(), key=key)
