"""What one request needs on a replica, and what it holds there: pure values and arithmetic.

`Demand` is a request's bound (its worst case) and what to reserve now (the worst case, or in
predicted mode the prompt plus a lookahead); `Slot` is an admitted request's hold on one
replica's ledger, which `growth_target` keeps ahead of the answer. No I/O: `kvgate.admission.stage`
moves leases in the store.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgate.admission.shared_prefix import SharedUse, credit_blocks, exact_shared_blocks
from kvgate.fleet.block_index import block_keys
from kvgate.fleet.replicas import Replica

if TYPE_CHECKING:
    from kvgate.fleet.snapshot import ReplicaView


def ledger_key(replica_id: str) -> str:
    """The state-store key of a replica's block ledger."""
    return f"ledger:{replica_id}"


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request needs: its worst case in tokens (the bound), what to reserve now, and
    who asks."""

    pool: str
    model: str
    worst_tokens: int
    tenant: str  # whom the queue shares fairly among: the tenant, or a flow of an anonymous one
    priority: str
    prefix_key: str | None = None  # identifies the prompt's shareable prefix
    prefix_tokens: int = 0
    # the prompt's token ids, where kvgate knows them exactly (one prompt, one sequence): its
    # blocks are then shared by their content, not by the first message's estimate
    token_ids: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    _keys: dict[int, Sequence[Hashable]] = field(default_factory=dict, compare=False, repr=False)
    # The longest the request may hold its reservation (its total timeout): a lease held
    # longer was leaked, and the keeper drops it.
    max_hold_s: float | None = None
    # predicted mode: what to reserve beyond the prompt at admission (all sequences); the
    # reservation then grows to stay `margin_tokens` ahead of what the answer has written, and
    # at least at `forecast(written)` (the tokens an answer that got this far is expected to
    # hold at its end), never past the worst case. None: reserve the worst case.
    ahead_tokens: int | None = None
    prompt_tokens: int = 0
    margin_tokens: int = 0
    forecast: Callable[[int], int] | None = field(default=None, compare=False)
    # the chance that the request, having written so many tokens (prompt + output, all
    # sequences), writes so many more before it ends: its length model's survival curve, for
    # work conservation (`kvgate.admission.room`). None: no curve (it ends at its reservation)
    alive: Callable[[int, int], float] | None = field(default=None, compare=False)
    # vLLM runs it ahead of what waits there (its pool schedules by priority, and its class
    # is critical): a long vLLM queue is then no reason to keep it in kvgate's
    first_in_vllm: bool = False

    @property
    def reserve_tokens(self) -> int:
        """Tokens to reserve at admission."""
        if self.ahead_tokens is None:
            return self.worst_tokens
        return min(self.worst_tokens, self.prompt_tokens + self.ahead_tokens)

    @property
    def predicted(self) -> bool:
        return self.reserve_tokens < self.worst_tokens

    def blocks_on(self, replica: Replica) -> int:
        """Blocks to reserve on `replica` now."""
        return math.ceil(self.reserve_tokens / (replica.kv_block_size))

    def worst_blocks_on(self, replica: Replica) -> int:
        return math.ceil(self.worst_tokens / (replica.kv_block_size))

    def limit_on(self, view: ReplicaView) -> int | None:
        """The most `view`'s ledger may hold with this request on it."""
        return view.limit(self.predicted, self.priority, self.blocks_on(view.replica))

    def shared_keys(self, block_size: int) -> Sequence[Hashable]:
        """The keys of the prompt's blocks that live requests with the same leading tokens
        share on a replica of `block_size` (`kvgate.admission.shared_prefix`): with exact
        token ids, their chained content keys; else the first message's estimated full
        blocks, less one, keyed by the prefix and their place. Made once per block size."""
        keys = self._keys.get(block_size)
        if keys is None:
            if self.token_ids is not None:
                blocks = exact_shared_blocks(len(self.token_ids), block_size)
                keys = block_keys(self.token_ids[: blocks * block_size], block_size)
            elif self.prefix_key is not None:
                keys = [(self.prefix_key, i) for i in range(credit_blocks(self.prefix_tokens, block_size))]
            else:
                keys = []
            self._keys[block_size] = keys
        return keys

    def shared_keys_on(self, replica: Replica) -> Sequence[Hashable]:
        """`shared_keys` on `replica`, never more than the request reserves there."""
        return self.shared_keys(replica.kv_block_size)[: self.blocks_on(replica)]


@dataclass(eq=False, slots=True)
class Slot:
    """An admitted request's hold on a replica."""

    replica: Replica
    lease_id: str
    blocks: int  # reserved for this request alone (grows with a predicted answer)
    queued_s: float = 0.0
    shared: SharedUse | None = None  # the blocks it shares with others
    released: bool = False
    queued: bool = False  # it waited in the queue (was not admitted on arrival)
    worst_blocks: int = 0  # the request's bound: growth never goes past it
    # tokens the request has written so far (prompt + output), set by the request path; a
    # predicted reservation grows to stay `ahead` tokens ahead of it, and to `forecast` of it
    progress: Callable[[], int] | None = None
    ahead: int = 0
    forecast: Callable[[int], int] | None = None
    alive: Callable[[int, int], float] | None = None  # `Demand.alive`
    exact: bool = False  # it reserved its worst case: it holds all it reserves
    lower_class: bool = False  # a class below critical (counted in `Ledger.lower`)

    @property
    def reserved_blocks(self) -> int:
        """Blocks reserved for the request, its share of the prefix included."""
        return self.blocks + (self.shared.blocks if self.shared else 0)


def growth_target(slot: Slot) -> int | None:
    """The blocks a predicted reservation should hold now, or None if it is still far enough
    ahead of its answer. Once what it has written comes within half its lookahead of the end,
    it grows to a full lookahead ahead again (at least a block), so vLLM finds the blocks it
    needs already accounted for; never past the request's worst case."""
    if slot.progress is None or slot.released:
        return None
    size = slot.replica.kv_block_size
    held = slot.reserved_blocks
    ceiling = slot.worst_blocks + (slot.shared.blocks if slot.shared else 0)
    if held >= ceiling:
        return None
    written = slot.progress()
    ahead = max(size, slot.ahead)
    if written + ahead // 2 <= held * size:
        return None
    wanted = written + ahead
    if slot.forecast is not None:
        wanted = max(wanted, slot.forecast(written))
    return min(ceiling, math.ceil(wanted / size))

