"""One request's exchange with the gateway: the one record of it, made at the data plane's
edge (the HTTP middleware, the picker's stream) and filled by the stages in order, each fact
by one writer:

    edge      request_id, key, started, headers, rt      Exchange.arriving
    handler   endpoint, raw                              the plane reads the body
    front     model, tenant_name (as each is learned:    FrontStage.take, as it learns them
              a refusal is labelled by them)
              front (parsed, count, edited, fingerprint, Gateway.take_front
              the tenant as it runs)
    size      sized (terms, pool, bound), arrival        Gateway.size
    plan      planned (route, payload)                   Gateway.plan; exclude, on failover
    charge    charge                                     the budgets' context
    attempts  attempts, ranking, slot, response, since   Gateway.attempt, the attempts stage
    settle    settling, charged_tokens                   Settlement.settle
    end       how it ended                               kvgate.request.ending.finish reads it

A stage reads only what the stages before it filled (reading a stage's result before it is
there is a bug, and asserts). The record holds no aiohttp request or response object: the
client's side stays with the handler and the relay (`kvgate.transport.relay`), so the policy
stages serve either data plane.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from aiohttp import web

from kvgate.admission.demand import Demand, Slot
from kvgate.config import TenantConfig
from kvgate.fleet.snapshot import Fleet
from kvgate.request.calibration import Terms
from kvgate.request.catalog import Bound
from kvgate.request.front import Front
from kvgate.request.parsed import Endpoint, ParsedRequest
from kvgate.request.tokens import PromptCount
from kvgate.routing.ranking import Ranking
from kvgate.routing.route import Route
from kvgate.runtime import Runtime
from kvgate.tenants import Charge
from kvgate.transport.base import Outcome, UpstreamRequest, UpstreamResponse, upstream_headers

_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True, slots=True)
class Sized:
    """What vLLM will count (`terms`), the pool chosen, and the worst case there."""

    terms: Terms
    pool: str
    bound: Bound


@dataclass(frozen=True, slots=True)
class Planned:
    """Where the request prefers to run and what to reserve there (its route's demand), and
    the body to send."""

    route: Route
    payload: bytes  # the client's bytes unless kvgate edited them


@dataclass(slots=True)
class Exchange:
    request_id: str  # the client's X-Request-Id if it sent a sane one, echoed and forwarded
    key: str  # kvgate's own id for the request: clients may send the same X-Request-Id twice
    started: float  # monotonic
    headers: Mapping[str, str]  # the client's (case-insensitive)
    rt: Runtime  # this request's config, whatever a reload does meanwhile
    endpoint: Endpoint | None = None  # an OpenAI endpoint's request; None: anything else
    raw: bytes = b""  # the client's body
    # front: labels as the front learns them, then its result
    model: str = "unknown"
    tenant_name: str = "unknown"
    front: Front | None = None  # its tenant as the request runs (under its objective)
    # size
    sized: Sized | None = None
    arrival: Fleet | None = None  # the fleet at arrival: good for the first ranking if fresh
    # plan (failover excludes a failed replica from its route: `exclude`)
    planned: Planned | None = None
    # charge
    charge: Charge | None = None
    # attempts: one Outcome each; the last is what the tenant pays for
    attempts: list[Outcome] = field(default_factory=lambda: [Outcome()])
    ranking: Ranking | None = None  # the attempt's last ranking: where it preferred to run
    slot: Slot | None = None  # where the last attempt was admitted
    response: UpstreamResponse | None = None  # the replica's answer to the attempt
    since: float | None = None  # when it first asked for admission, once sent back as busy
    # settle
    settling: asyncio.Future[None] | None = None  # settling begun beside the release
    charged_tokens: int | None = None  # what the tenant paid in the end

    @classmethod
    def arriving(cls, headers: Mapping[str, str], rt: Runtime) -> Exchange:
        """A new request's record, with the client's X-Request-Id where it is sane."""
        key = os.urandom(16).hex()
        given = headers.get("X-Request-Id", "")
        # echoed in a response header: visible ASCII only, nothing a header could be split on
        request_id = given if 0 < len(given) <= 128 and _VISIBLE_ASCII.fullmatch(given) else key
        return cls(request_id, key, time.monotonic(), headers, rt)

    @property
    def attempt(self) -> Outcome:
        """The attempt under way (or the last one)."""
        return self.attempts[-1]

    # what the stages left, for those after them

    @property
    def parsed(self) -> ParsedRequest:
        assert self.front is not None, "read before the front"
        return self.front.parsed

    @property
    def count(self) -> PromptCount:
        assert self.front is not None, "read before the front"
        return self.front.count

    @property
    def tenant(self) -> TenantConfig:
        assert self.front is not None, "read before the front"
        return self.front.tenant

    @property
    def bound(self) -> Bound:
        assert self.sized is not None, "read before the size"
        return self.sized.bound

    @property
    def pool(self) -> str:
        assert self.sized is not None, "read before the size"
        return self.sized.pool

    @property
    def demand(self) -> Demand:
        assert self.planned is not None, "read before the plan"
        return self.planned.route.demand

    @property
    def route(self) -> Route:
        assert self.planned is not None, "read before the plan"
        return self.planned.route

    @property
    def payload(self) -> bytes:
        assert self.planned is not None, "read before the plan"
        return self.planned.payload

    def exclude(self, replica_id: str) -> None:
        """The request goes on elsewhere: never again to `replica_id`."""
        assert self.planned is not None, "read before the plan"
        route = self.planned.route
        self.planned = replace(
            self.planned, route=replace(route, exclude=route.exclude | {replica_id})
        )

    @property
    def hold_s(self) -> float:
        """How long the tenant's charge may be held: every attempt's wait and run."""
        config = self.rt.config
        attempts = 1 + config.routing.retry.attempts
        return attempts * (config.admission.queue.max_wait_s + (self.demand.max_hold_s or 0.0))

    # what the admitted attempt sends, and what kvgate adds to the client's answer

    def upstream_request(self) -> UpstreamRequest:
        assert self.slot is not None, "read before admission"
        replica, config = self.slot.replica, self.rt.config
        headers = upstream_headers(
            self.headers, self.request_id, replica,
            drop_authorization=config.auth.mode != "none", rank=self.attempt.rank,
        )
        return UpstreamRequest(
            replica, self.parsed.endpoint.value, self.payload, headers, config.timeouts,
            stream=self.parsed.stream, holder=self.key, attempt=self.attempt,
        )

    def response_headers(self) -> dict[str, str]:
        assert self.slot is not None and self.charge is not None, "read before admission"
        headers = {
            **self.charge.headers,
            "X-Request-Id": self.request_id,
            "X-Kvgate-Pool": self.pool,
            "X-Kvgate-Replica": self.slot.replica.id,
        }
        if self.rt.config.server.accounting_headers:
            headers["X-Kvgate-Prompt-Tokens"] = str(self.bound.prompt_tokens)
            headers["X-Kvgate-Reserved-Blocks"] = str(self.slot.reserved_blocks)
        return headers

    # how it went, for the ending's record (`kvgate.request.ending`)

    @property
    def pool_label(self) -> str:
        return "none" if self.sized is None else self.sized.pool

    @property
    def replica(self) -> str | None:
        return None if self.slot is None else self.slot.replica.id

    @property
    def delivered(self) -> bool:
        """The client was sent the whole answer."""
        return self.attempt.done

    @property
    def disconnected(self) -> bool:
        """The client left before it had the whole answer."""
        return self.attempt.client_disconnected and not self.attempt.done

    @property
    def ttft_s(self) -> float | None:
        """Arrival to the first streamed token (or the whole answer)."""
        first = self.attempt.first_token_at
        return None if first is None else first - self.started


# where the HTTP middleware keeps a request's exchange, for its handler
EXCHANGE = web.RequestKey("kvgate_exchange", Exchange)
