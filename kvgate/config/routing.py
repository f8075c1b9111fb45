"""The routing sections of the configuration: discovery, sessions, retries, the circuit
breaker and the scorers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from kvgate.config.base import PositiveFloat, PositiveInt, Section


class DiscoveryConfig(Section):
    interval_s: PositiveFloat = 2.0
    timeout_s: PositiveFloat = 1.0
    # Checks in a row that must fail (late, or answered 5xx) before a replica counts as
    # unhealthy: an API server busy generating answers late, and late is not failing. A
    # refused connection (nothing listens there) counts at once.
    failure_threshold: PositiveInt = 3
    # Scraped figures older than this are treated as unknown.
    stale_after_s: PositiveFloat = 10.0


SessionSource = Literal["header", "user", "conversation"]


class SessionsConfig(Section):
    """Sticky sessions: a request with a session key goes where the key is bound (in the state
    store, shared by every instance), while that replica can take it."""

    # Where the key comes from, first found wins: the `header`, the body's `user` field, or a
    # hash of the conversation's first `conversation_messages` messages (so a multi-turn chat
    # that resends its history lands where that history is cached).
    sources: list[SessionSource] = ["header", "user", "conversation"]
    header: str = "X-Session-Id"
    conversation_messages: PositiveInt = 2
    ttl_s: PositiveFloat = 1800.0  # refreshed on every use
    # How long a request waits for its bound replica to have room before it is rebound.
    affinity_wait_s: float = Field(0.25, ge=0)


class RetryConfig(Section):
    """A request whose replica failed before any byte reached the client is sent once more to
    another replica (never after streaming began): its blocks are given back on the first and
    reserved on the second (it may wait there like any request); the tenant is charged once."""

    attempts: int = Field(1, ge=0, le=5)  # extra attempts; 0: never retry
    on_timeout: bool = False  # also after first_byte_s passed (the replica may still be working)


class CircuitConfig(Section):
    failure_threshold: PositiveInt = 3  # consecutive failures that open the circuit
    open_s: PositiveFloat = 10.0  # then one trial request is let through


class RoutingConfig(Section):
    # Scorers by name with their weights; each scores a replica in [0, 1] and the replica with
    # the highest weighted sum is tried first (admission takes the first that fits). Names:
    # session, prefix_affinity, least_loaded, round_robin (kvgate.routing.plugins).
    scorers: dict[str, Annotated[float, Field(ge=0)]] = {
        "session": 4.0, "prefix_affinity": 2.0, "least_loaded": 1.0,
    }
    # Routing plugins by name with their parameters, over the defaults each takes from the
    # sections below (`session` from `sessions`, load_factor and load_floor); naming one here
    # also runs it when it does not score. Checked against each plugin's own parameters.
    plugins: dict[str, dict[str, Any]] = {}
    # Bounded load: an affinity (a session's replica, a prefix's replica) is honoured while that
    # replica would hold at most (1 + load_factor) × its capacity-weighted fair share of the
    # pool's reserved blocks; beyond, the request goes elsewhere (and its session is rebound).
    load_factor: float = Field(0.25, ge=0)
    # ...unless it holds less than this share of its admissible blocks: then every affinity is
    # honoured (a light load has nothing to balance).
    load_floor: float = Field(0.1, ge=0, le=1)
    sessions: SessionsConfig = SessionsConfig()
    retry: RetryConfig = RetryConfig()
    circuit: CircuitConfig = CircuitConfig()

    @field_validator("scorers")
    @classmethod
    def _some_scorer(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("name at least one scorer")
        return value
