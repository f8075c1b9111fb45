"""What the simulated engine reports: its counters, each sampled token, each step's result."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.sim.request import FinishReason, SimRequest


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters since the engine started (a restart starts from zero)."""

    steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    aborted: int = 0


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One sampled token. `index` is its position in the output (0 = the first token)."""

    request: SimRequest
    index: int
    finish_reason: FinishReason | None
    inter_token_s: float | None


@dataclass(frozen=True, slots=True)
class StepResult:
    start_time: float
    cost_s: float
    scheduled: dict[str, int]
    num_prefill_tokens: int
    num_decode_seqs: int
    outputs: list[TokenOutput]
    preempted: list[str]
    finished: list[SimRequest]

    @property
    def end_time(self) -> float:
        return self.start_time + self.cost_s

    @property
    def idle(self) -> bool:
        return not self.scheduled
