"""Pool choice: long-context requests go to a pool of their own.

Each pool has `min_worst_case_tokens`; a request goes to the pool with the highest threshold
its worst case reaches, among the pools its tenant may use. Pools are tried in that order,
then along `overflow_to` when the chosen pool has no healthy replica for the model.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.config import PoolConfig
from kvgate.errors import Forbidden


def choose_pool(
    pools: Mapping[str, PoolConfig], worst_tokens: int, allowed: list[str] | None
) -> str:
    eligible = [
        (pool.min_worst_case_tokens, name)
        for name, pool in pools.items()
        if allowed is None or name in allowed
    ]
    if not eligible:
        raise Forbidden("this tenant may not use any pool", code="pool_not_allowed")
    reached = [entry for entry in eligible if entry[0] <= worst_tokens]
    # A request smaller than every threshold goes to the pool with the lowest one.
    return max(reached)[1] if reached else min(eligible)[1]


def overflow_chain(pools: Mapping[str, PoolConfig], first: str) -> list[str]:
    chain = [first]
    while (nxt := pools[chain[-1]].overflow_to) is not None and nxt not in chain:
        chain.append(nxt)
    return chain
