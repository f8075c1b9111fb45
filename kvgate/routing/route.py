"""What the router needs to know of one request: a frozen value, built once by the gateway."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.admission.demand import Demand


@dataclass(frozen=True, slots=True)
class Route:
    demand: Demand  # model, pool, tenant and class, what to reserve and the worst case
    session_key: str | None = None
    prefix: str | None = None  # fingerprint of the prompt's leading part (system prompt, tools)
    exclude: frozenset[str] = frozenset()  # replicas that already failed this request
    holder: str | None = None  # the request, as the circuit breaker knows it (its trial's)
    # the prompt's token ids as vLLM will see them, where kvgate knows them exactly: what
    # precise prefix routing looks up in the replicas' KV-event indexes
    token_ids: tuple[int, ...] | None = None
