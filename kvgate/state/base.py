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

Every call is one atomic step (one Lua script in Redis), so N instances enforce one limit.
Implementations raise `StateStoreError` when the backend cannot be reached (within a short
timeout: a store never hangs a request); what to do then is the caller's configured decision.
Amounts are non-negative integers; times are seconds (float).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


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
