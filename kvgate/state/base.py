"""The state-store contract: everything several kvgate instances must agree on.

Three primitives cover the gateway's shared state:

* **Leases** (`try_acquire` / `release` / `renew` / `held`): a bounded pool of units keyed by
  name, e.g. a replica's KV blocks (`ledger:<replica>`, limit = admissible blocks) or a tenant's
  concurrent requests (`concurrency:<tenant>`, limit = max concurrent). Each holding is a lease
  with an id and an expiry; an expired lease no longer counts, so a crashed instance's holdings
  come back by themselves. `release` is idempotent: the first call frees, later calls return 0.
* **Token buckets** (`take` / `put_back`): rate limits in tokens or requests per interval.
  `take` is all-or-nothing unless `force` (used when settling a charge that turned out larger
  than reserved: the tokens were spent, so the bucket goes into debt). `put_back` refunds, never
  above the bucket's capacity.
* **Bindings** (`bind` / `lookup` / `unbind`): a value per key with a TTL; `bind` is
  set-if-absent or compare-and-set. Session → replica bindings live here.
* **Composite steps** (`charge` / `settle`): a lease and several buckets in one step, for a
  tenant's admission and its end (one store call where there would be three, and no partial
  holds to give back). `charge` takes a lease and an amount from each bucket, all or
  nothing; `settle` releases a lease and corrects buckets (a refund put back, an overdraw taken
  by force). They mean exactly what the single calls would mean, done at one instant.

Names group: a pool or bucket named `<group>/<part>` (e.g. `tenant:team/concurrency`,
`tenant:team/tokens`) is kept beside every other name of its group, so one composite step may
touch them together (Redis: one hash tag, one Cluster slot). A composite step's lease and
buckets must share one group; a name without `/` is a group of its own.

Every call is one atomic step (one Lua script in Redis), so N instances enforce one limit.
Implementations raise `StateStoreError` when the backend cannot be reached (within a short
timeout: a store never hangs a request); what to do then is the caller's configured decision.
Amounts are non-negative integers (a correction's `delta` is signed); times are seconds (float).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class StateStoreError(RuntimeError):
    """The backend is unreachable or timed out."""


@dataclass(frozen=True, slots=True)
class BucketLimit:
    """`capacity` units, refilled continuously at `capacity / period_s` per second."""

    capacity: int
    period_s: float = 60.0

    @property
    def rate_per_s(self) -> float:
        return self.capacity / self.period_s


@dataclass(frozen=True, slots=True)
class BucketState:
    allowed: bool
    remaining: int  # units left after this call (may be negative after a forced take)
    retry_after_s: float  # when `amount` would fit (0 if allowed)
    reset_s: float  # when the bucket is full again


@dataclass(frozen=True, slots=True)
class LeaseHold:
    """`amount` units of `pool` held as lease `lease_id`, within `limit`, for `ttl_s`."""

    pool: str
    lease_id: str
    amount: int
    limit: int
    ttl_s: float


@dataclass(frozen=True, slots=True)
class BucketTake:
    """`amount` units of `bucket`, a token bucket under `limit`."""

    bucket: str
    amount: int
    limit: BucketLimit


@dataclass(frozen=True, slots=True)
class BucketCorrection:
    """A bucket set right after the fact: `delta` > 0 is put back (a refund, capped at the
    capacity), `delta` < 0 is taken by force (used beyond what was taken: debt)."""

    bucket: str
    delta: int
    limit: BucketLimit


@dataclass(frozen=True, slots=True)
class Charged:
    """What `charge` found. `lease_fits`: the lease fits its pool (True when there was none).
    `buckets`: one state per take, in order; `allowed` says whether that take fits, and
    `remaining` is the level after the step (after the take when `granted`, untouched else)."""

    lease_fits: bool
    buckets: tuple[BucketState, ...]

    @property
    def granted(self) -> bool:
        """Everything was taken; otherwise nothing was."""
        return self.lease_fits and all(state.allowed for state in self.buckets)


@dataclass(frozen=True, slots=True)
class Settled:
    """What `settle` did: the units the release freed (0: no lease, or already gone) and one
    state per correction, in order, after it."""

    released: int
    buckets: tuple[BucketState, ...]


class StateStore(Protocol):
    backend: str  # "memory" or "redis"

    async def try_acquire(
        self, pool: str, lease_id: str, amount: int, limit: int, ttl_s: float
    ) -> bool:
        """Hold `amount` units of `pool` if the live holdings plus `amount` stay ≤ `limit`.

        Re-acquiring an existing lease id replaces its amount (and checks the limit again).
        """
        ...

    async def release(self, pool: str, lease_id: str) -> int:
        """Drop the lease; returns the units freed (0 if it was already released or expired)."""
        ...

    async def renew(self, pool: str, lease_ids: list[str], ttl_s: float) -> int:
        """Push the expiry of live leases to now + ttl_s; returns how many were still live."""
        ...

    async def held(self, pool: str) -> int:
        """Units held by live leases in `pool`."""
        ...

    async def take(
        self, bucket: str, amount: int, limit: BucketLimit, *, force: bool = False
    ) -> BucketState:
        """Take `amount` from the bucket if it holds that many (or always, with `force`)."""
        ...

    async def put_back(self, bucket: str, amount: int, limit: BucketLimit) -> BucketState:
        """Return `amount` units (a refund), capped at the bucket's capacity."""
        ...

    async def peek(self, bucket: str, limit: BucketLimit) -> BucketState:
        """The bucket's state now, without changing it."""
        ...

    async def charge(self, lease: LeaseHold | None, takes: Sequence[BucketTake]) -> Charged:
        """Hold `lease` (as `try_acquire` would) and take every amount (as `take` would), all
        in one step, only if every one fits; otherwise change nothing. Each bucket at most
        once; the lease and the buckets in one name group."""
        ...

    async def settle(
        self, release: LeaseHold | None, corrections: Sequence[BucketCorrection]
    ) -> Settled:
        """Release the lease `release` names (its pool and id; as `release` would: idempotent,
        announced to watchers) and apply every correction, in one step. Each bucket at most once, all in the
        lease's name group."""
        ...

    async def bind(self, key: str, value: str, ttl_s: float, *, replace: str | None = None) -> str:
        """Bind key → value (TTL ttl_s) if the key is unbound, already bound to `value`, or bound
        to `replace` (compare-and-set, for rebinding). Returns the value in force after the call:
        another instance's binding when it got there first."""
        ...

    async def lookup(self, key: str) -> str | None: ...

    async def unbind(self, key: str) -> None: ...

    async def watch_releases(self, on_release: Callable[[str], None]) -> None:
        """Call `on_release(pool)` whenever any instance sharing this store releases a lease,
        until cancelled; best effort (a lost notice only delays a waiter until its next poll).
        A store that only this instance uses has nothing to announce and just waits."""
        ...

    async def ping(self) -> float:
        """Round-trip time in seconds; raises StateStoreError when down."""
        ...

    async def close(self) -> None: ...


# What a store may also tell, for /metrics (`kvgate.app`); a store that does not, exports none.


@runtime_checkable
class CountsCalls(Protocol):
    """A store that talks to a server: the commands it sent, and in how many round trips."""

    @property
    def calls(self) -> int: ...

    @property
    def round_trips(self) -> int: ...


@runtime_checkable
class FallsBack(Protocol):
    """A store that serves from a fallback while its primary is down
    (`kvgate.state.resilient.ResilientStore`)."""

    up: bool
    last_latency_s: float
    errors: int
    fallback_calls: int
    reconciled_units: int

    @property
    def outage_seconds(self) -> float: ...
