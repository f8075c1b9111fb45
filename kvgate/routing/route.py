"""What the router needs to know of one request: a frozen value, built once by the gateway."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.admission.demand import Demand
from kvgate.fleet.block_index import LazyKeys


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
    # its block keys by block size, made as asked (`prompt_keys`): shared by its copies
    keys: dict[int, LazyKeys] = field(default_factory=dict, compare=False, repr=False)

    def prompt_keys(self, block_size: int) -> LazyKeys | None:
        """The prompt's block keys at `block_size`, one object for the whole request: every
        ranking, placement attempt and send reads the same, and each key is hashed once.
        None where its token ids are not known."""
        if self.token_ids is None:
            return None
        keys = self.keys.get(block_size)
        if keys is None:
            keys = self.keys[block_size] = LazyKeys(self.token_ids, block_size)
        return keys
