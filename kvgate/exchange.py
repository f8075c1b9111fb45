"""One request's exchange with the gateway: the record its stages read and fill, in order.

    front     parsed, tenant, count, fingerprint, edited  parse, identify, normalize, count
    size      terms, arrival, pool, bound                 vLLM's count, the pool, worst case
    plan      demand, route, payload                      what to reserve, where, what to send
    charge    charge                                      the tenant's budget, reserved
    attempts  attempts, ranking, slot, response, since    admit, forward; again on failover
    settle    settling                                    the charge corrected

A stage reads only what the stages before it filled. The record holds no aiohttp request or
response object: the client's side stays with the handler and the relay
(`kvgate.transport.relay`), so the policy stages could serve another data plane.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgate.admission.demand import Demand, Slot
from kvgate.config import TenantConfig
from kvgate.fleet.snapshot import Fleet
from kvgate.request.calibration import Terms
from kvgate.request.catalog import Bound
from kvgate.request.info import RequestInfo
from kvgate.request.parsed import Endpoint, ParsedRequest
from kvgate.request.tokens import PromptCount
from kvgate.routing.ranking import Ranking
from kvgate.routing.route import Route
from kvgate.runtime import Runtime
from kvgate.tenants import Charge
from kvgate.transport.base import Outcome, UpstreamResponse


@dataclass(slots=True)
class Exchange:
    rt: Runtime  # this request's config, whatever a reload does meanwhile
    info: RequestInfo  # its labels, for metrics, logs and headers
    endpoint: Endpoint
    headers: Mapping[str, str]  # the client's
    raw: bytes = b""  # the client's body
    # front
    parsed: ParsedRequest = field(default=None)  # type: ignore[assignment]
    tenant: TenantConfig = field(default=None)  # type: ignore[assignment]
    count: PromptCount = field(default=None)  # type: ignore[assignment]
    fingerprint: str | None = None  # the normalized system prompt and tools
    edited: bool = False  # normalization changed the body: forwarded serialized
    # size
    terms: Terms = field(default=None)  # type: ignore[assignment]
    arrival: Fleet | None = None  # the fleet at arrival: good for the first ranking if fresh
    pool: str = ""
    bound: Bound = field(default=None)  # type: ignore[assignment]
    # plan
    demand: Demand = field(default=None)  # type: ignore[assignment]
    route: Route = field(default=None)  # type: ignore[assignment]
    payload: bytes = b""  # the body for the replica: the client's bytes unless kvgate edited them
    # charge
    charge: Charge = field(default=None)  # type: ignore[assignment]
    # attempts: one Outcome each; the last is what the tenant pays for
    attempts: list[Outcome] = field(default_factory=lambda: [Outcome()])
    ranking: Ranking | None = None  # the attempt's last ranking: where it preferred to run
    slot: Slot | None = None  # where the attempt was admitted
    response: UpstreamResponse | None = None  # the replica's answer to the attempt
    since: float | None = None  # when it first asked for admission, once sent back as busy
    # settle
    settling: asyncio.Future[None] | None = None  # settling begun beside the release

    @property
    def attempt(self) -> Outcome:
        """The attempt under way (or the last one)."""
        return self.attempts[-1]
