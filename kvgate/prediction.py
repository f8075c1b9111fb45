"""How long an answer is likely to be: a high quantile of recent completions.

Real answers use a small fraction of `max_tokens` (a few hundred tokens of a 4,096 allowance
is typical), so reserving the allowance idles most of the blocks it holds: with realistic
lengths kvgate held 82% of a replica in reservations while vLLM held 4.5%. Admission in
`predicted` mode reserves the prompt plus this prediction instead, and grows the reservation
if the answer outruns it (`kvgate.growth`).

The prediction is the `quantile` of the last `window` completions (tokens per sequence) of the
same tenant and model, capped by the request's own max_tokens; with fewer than `min_samples`
of its own, the model's completions across tenants; with fewer than that, none (the caller
falls back to the worst case). Pure: no clock, no I/O.
"""

from __future__ import annotations

import bisect
from collections import deque

ANY_TENANT = "*"


class OutputPredictor:
    def __init__(self, quantile: float = 0.95, window: int = 256, min_samples: int = 16) -> None:
        if not 0 < quantile <= 1:
            raise ValueError("quantile must be in (0, 1]")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self._recent: dict[tuple[str, str], deque[int]] = {}
        self._sorted: dict[tuple[str, str], list[int]] = {}

    def observe(self, tenant: str, model: str, completion_tokens: int) -> None:
        """One sequence's completion length, from vLLM's usage."""
        if completion_tokens < 0:
            return
        for key in ((tenant, model), (ANY_TENANT, model)):
            recent = self._recent.setdefault(key, deque())
            ordered = self._sorted.setdefault(key, [])
            if len(recent) >= self.window:
                old = recent.popleft()
                del ordered[bisect.bisect_left(ordered, old)]
            recent.append(completion_tokens)
            bisect.insort(ordered, completion_tokens)

    def predict(self, tenant: str, model: str, max_tokens: int) -> int | None:
        """Tokens one sequence of this request will likely generate, at most max_tokens; None
        while too little is known."""
        for key in ((tenant, model), (ANY_TENANT, model)):
            ordered = self._sorted.get(key)
            if ordered is not None and len(ordered) >= self.min_samples:
                index = min(len(ordered) - 1, int(self.quantile * len(ordered)))
                return max(1, min(max_tokens, ordered[index]))
        return None
