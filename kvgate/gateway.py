"""The request path, top to bottom, and the services it calls.

    parse & validate → identify tenant → count tokens → choose pool, bound worst case
    → charge tenant budget → rank replicas (router) → admit on the first one's ledger with
    room (or wait in the fair queue, ranked again each attempt) → forward and stream back
    (once more elsewhere if the replica failed before any byte reached the client; placed
    again, elsewhere or from the queue, if its vLLM refused it as busy)
    → settle: release blocks, correct the charge, record metrics

`run` is that diagram: each step a call of a stage that reads and fills the request's
`Exchange` record, whichever data plane serves the request (`Plane`: kvgate's own HTTP proxy,
`handle`; or Envoy, with kvgate as its endpoint picker, `kvgate.epp`). Each resource is held
by an `async with`, so every ending — completion, upstream error, timeout, client
disconnect, cancellation — releases it exactly once. Every stage reads the request's own
config snapshot, `x.rt` (`kvgate.runtime`), taken when the request starts.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

from aiohttp import web

from kvgate.admission.prediction import LengthModel
from kvgate.admission.progress import written_tokens
from kvgate.admission.sizing import Sizing
from kvgate.admission.stage import Admission
from kvgate.config import CurrentConfig
from kvgate.exchange import EXCHANGE, Exchange, Planned, Sized
from kvgate.fleet.health import Breakers
from kvgate.fleet.kv_events import KvEvents
from kvgate.fleet.replicas import Registry, Writing
from kvgate.fleet.view import FleetView
from kvgate.metrics import Metrics
from kvgate.protect import begin, finish
from kvgate.request.calibration import Calibration
from kvgate.request.catalog import (
    bound_worst_case,
    pool_priority,
    pool_tokens,
    prompts_of,
    upstream_payload,
)
from kvgate.request.front import FrontStage, allowed
from kvgate.request.parsed import MODEL_REWRITE, Endpoint, read_body
from kvgate.request.settle import Settlement
from kvgate.routing.pools import choose_pool, overflow_chain
from kvgate.routing.ranking import Ranking
from kvgate.routing.route import Route
from kvgate.routing.router import Router
from kvgate.routing.sessions import session_key
from kvgate.runtime import Runtime
from kvgate.tenants import FAIRNESS_ID, OBJECTIVE, Budgets, under_objective
from kvgate.transport.attempts import Attempts
from kvgate.transport.base import Transport
from kvgate.transport.breaker import BreakerTransport
from kvgate.transport.http import HttpTransport
from kvgate.transport.plane import Plane, T
from kvgate.transport.relay import relay


@dataclass(slots=True)
class Gateway:
    runtime: Runtime  # in force now: a request takes it at its start; a reload replaces it
    # `runtime.config`, read when asked: the one way background stages read the config
    current: CurrentConfig
    registry: Registry
    admission: Admission
    budgets: Budgets
    front: FrontStage  # parse, identify, normalize and count: on the loop or in a worker
    metrics: Metrics
    calibration: Calibration
    router: Router
    breakers: Breakers
    view: FleetView  # the one fleet snapshot: routing, admission, gauges, the admin view
    kv_events: KvEvents  # what each replica really caches, from vLLM's KV cache events
    lengths: LengthModel = field(default_factory=LengthModel)
    # the upstream, once the event loop runs (`connect`): the HTTP transport, and the
    # transport attempts go through (judged for the breakers)
    http: HttpTransport | None = None
    transport: Transport | None = None
    sizing: Sizing = field(init=False)
    attempts: Attempts = field(init=False)
    settlement: Settlement = field(init=False)

    def __post_init__(self) -> None:
        self.sizing = Sizing(self.calibration, self.metrics, self.lengths)
        self.attempts = Attempts(self.breakers, self.metrics)
        self.settlement = Settlement(self.budgets, self.sizing, lambda: self.http)

    def connect(self, http: HttpTransport) -> HttpTransport | None:
        """Send from now on over `http`; the transport it replaces, if any (its requests
        under way finish on it)."""
        old, self.http = self.http, http
        self.transport = BreakerTransport(http, self.breakers)
        return old

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """Proxy mode: kvgate reads the client's request and relays the replica's answer."""
        assert self.transport is not None
        x = request[EXCHANGE]
        x.endpoint = endpoint
        server = x.rt.config.server
        x.raw = await read_body(request, server.max_body_bytes, server.client_timeout_s)
        plane = Plane(self.transport, functools.partial(relay, request))
        return await self.run(x, request.remote, plane)

    async def run(self, x: Exchange, remote: str | None, plane: Plane[T]) -> T:
        """The request path, for a body read whole, served through `plane`."""
        await self.take_front(x, remote)  # parse & validate, identify, normalize, count
        self.size(x)  # what vLLM will count, the pool, the worst case
        self.plan(x, plane)  # what to reserve, where it prefers to run, what to send
        async with self.budgets.charge(x.tenant, x.bound.worst_tokens, x.hold_s) as x.charge:
            try:  # admit, forward and relay; again elsewhere where the attempts stage says
                attempt = functools.partial(self.attempt, plane)
                return await self.attempts.run(x, attempt, retries=plane.retries)
            finally:  # settle on every ending, whatever cancellation arrives meanwhile
                await finish(x.settling if x.settling is not None else self.settlement.settle(x))

    async def take_front(self, x: Exchange, remote: str | None) -> None:
        """Parse and validate, identify the tenant, normalize the prompt (counted,
        fingerprinted and forwarded as normalized), count its tokens; a large body in a
        worker process."""
        rt, headers = x.rt, x.headers
        assert x.endpoint is not None, "the handler names the endpoint"
        front = await self.front.take(
            x.raw, x.endpoint, rt, x,
            identify=lambda: rt.directory.identify(headers, remote),
            allow=functools.partial(allowed, self.registry.serves, rt),
            model=headers.get(MODEL_REWRITE),  # the gateway serves it as another model
        )
        tenant = under_objective(front.tenant, headers.get(OBJECTIVE), rt.config.objectives)
        # (dataclasses.replace costs microseconds: only where an objective changed the class)
        x.front = front if tenant is front.tenant else dataclasses.replace(front, tenant=tenant)

    def size(self, x: Exchange) -> None:
        """The terms of vLLM's count, the pool, and the worst case there. The pool is chosen
        on a provisional size (`pool_tokens`: the worst case where it does not depend on the
        context, else the prompt); the bound follows, once, under the pool's context."""
        rt, parsed = x.rt, x.parsed
        terms = self.sizing.terms(rt, parsed, x.count)  # vLLM's count, from kvgate's
        model = rt.config.model(parsed.model)
        prompts = prompts_of(x.count, terms)
        provisional = pool_tokens(parsed, prompts, model, x.tenant)
        first_pool = choose_pool(rt.config.pools, provisional, x.tenant.pools)
        x.arrival = self.view.take(rt.config)
        pool = self.router.pool(
            parsed.model, overflow_chain(rt.config.pools, first_pool), x.arrival
        )
        served_len = x.arrival.max_model_len(parsed.model, pool)
        bound = bound_worst_case(parsed, prompts, model, x.tenant, served_len)
        x.sized = Sized(terms, pool, bound)

    def plan(self, x: Exchange, plane: Plane[T]) -> None:
        """What to reserve, where the request prefers to run (only on the replicas the data
        plane allows), and the body to send (asking for a stream's usage where kvgate reads
        the answer)."""
        config = x.rt.config
        lane = x.rt.directory.fairness_lane(x.tenant, x.headers.get(FAIRNESS_ID))
        assert x.sized is not None and x.front is not None
        demand = self.sizing.demand(
            x.pool, x.parsed, x.tenant, x.bound, x.count, x.sized.terms, config, lane
        )
        route = Route(
            demand, session_key(x.parsed, x.headers, config.routing.sessions, x.tenant.name),
            # the normalized system prompt and tools; else the first message's text
            prefix=x.front.fingerprint or demand.prefix_key,
            holder=x.key,  # a half-open replica's trial is claimed by this request
            token_ids=x.count.token_ids,
            exclude=self.registry.outside(plane.subset),
        )
        priority = pool_priority(config, x.pool, x.tenant, x.parsed.body.get("priority"))
        payload = upstream_payload(
            x.parsed, x.bound, None if x.front.edited else x.raw, ask_usage=plane.sees_body,
            priority=priority,
        )
        x.planned = Planned(route, payload)

    async def attempt(self, plane: Plane[T], x: Exchange) -> T:
        """One attempt: admit on the best replica with room, forward, relay, and begin the
        settling while the slot is still held (its store calls start now, so the release on
        leaving the block goes in the same round trip)."""
        x.ranking = None
        tenant = x.rt.config.tenant(x.demand.tenant)
        target_s = tenant.ttft_target_s if tenant is not None else None  # over its class's
        async with self.admission.admit(
            x.demand, functools.partial(self.rank, x), x.rt.config.admission, x.since, target_s
        ) as x.slot:
            slot = x.slot
            response = await self.forward(plane, x)
            if x.ranking is not None:  # the routing plugins hear where it ran, and how
                await self.router.served(
                    x.route, x.ranking, slot.replica.id, x.rt.config.routing, x.attempt.status
                )
            x.settling = begin(self.settlement.settle(x))
            return response

    async def forward(self, plane: Plane[T], x: Exchange) -> T:
        """Send the attempt to the slot's replica and deliver its answer to the client."""
        assert x.slot is not None
        replica, attempt = x.slot.replica, x.attempt
        attempt.replica, attempt.decode_start = replica, replica.decode_clock.reading()
        attempt.body_seen = plane.sees_body
        x.slot.progress = written_tokens(x.parsed, x.bound, attempt)
        prompt = x.route.prompt_keys(replica.kv_block_size)
        attempt.rank = self.kv_events.rank_for(replica.id, prompt)
        self.kv_events.expect(replica.id, prompt, attempt.rank)
        replica.inflight[x.key] = Writing(  # `ended` takes it back, however this ends
            x.slot.progress, x.demand.shared_keys(replica.kv_block_size)
        )
        try:
            x.response = await plane.transport.send(x.upstream_request())
            return await plane.deliver(
                x.response, x.response_headers(), x.parsed.client_wants_usage
            )
        finally:
            self.ended(x)

    def ended(self, x: Exchange) -> None:
        """The replica's connection is done with: what the attempt tells of it and of the
        request, before the slot goes."""
        assert x.slot is not None
        slot, attempt, rt = x.slot, x.attempt, x.rt
        replica = slot.replica
        attempt.ended_at = time.monotonic()
        replica.inflight.pop(x.key, None)
        if not replica.inflight and self.http is not None:
            # none of ours runs there: its clock may hold from now
            self.http.read_metrics(replica, attempt.ended_at, rt.config.discovery.timeout_s)
        if attempt.busy is not None:  # before the slot goes: it is counted as held there
            self.admission.refused_busy(slot, attempt.busy, rt.config.admission)
        self.settlement.observe(x)

    async def rank(self, x: Exchange, waited_s: float) -> Ranking:
        """A half-open replica only for the request holding its trial; the ranking is kept
        in `x.ranking` for the router's post-response hook."""
        arrival, x.arrival = x.arrival, None  # a later ranking, or a retry, ranks afresh
        config = x.rt.config
        fleet = arrival if arrival is not None and self.view.still_current(arrival) else None
        if fleet is None:
            fleet = self.view.take(config)
        x.ranking = await self.router.rank(x.route, fleet, config.routing)
        return x.ranking
