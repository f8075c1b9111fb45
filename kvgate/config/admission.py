"""The admission sections of the configuration: the queue, answer-length prediction, the
admission limits and the calibration of prompt counts."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, model_validator

from kvgate.config.base import PositiveFloat, PositiveInt, PriorityClass, Section

log = logging.getLogger(__name__)

AdmissionMode = Literal["predicted", "worst_case"]


class QueueConfig(Section):
    max_depth: PositiveInt = 512
    # How long a request may wait for KV capacity, whatever its class: then 429 queue_timeout.
    max_wait_s: PositiveFloat = 60.0
    # Latency targets, opt-in: seconds to the first token a request of each class should see
    # (a tenant's own ttft_target_s wins). A request that kvgate expects could not start
    # within its target is refused at arrival (429 wait_budget_exceeded with Retry-After);
    # without a target a request waits for room, up to max_wait_s.
    ttft_target_s: dict[PriorityClass, PositiveFloat] = {}

    @model_validator(mode="before")
    @classmethod
    def _renamed_wait_budget(cls, data: Any) -> Any:
        """`wait_budget_s` was the class latency target's name: its values mean what
        `ttft_target_s` means, so an existing file keeps working, with a warning."""
        if not isinstance(data, dict) or "wait_budget_s" not in data:
            return data
        if "ttft_target_s" in data:
            raise ValueError("wait_budget_s is the old name of ttft_target_s: set only ttft_target_s")
        log.warning(
            "admission.queue.wait_budget_s is deprecated: it is now admission.queue."
            "ttft_target_s (the same values: per class, the wait after which a request is "
            "refused at arrival); rename the key"
        )
        data = dict(data)
        data["ttft_target_s"] = data.pop("wait_budget_s")
        return data

    def target(self, priority: str, tenant_target: float | None = None) -> float | None:
        """The latency target of a request of this class (the tenant's, if it has one)."""
        if tenant_target is not None:
            return tenant_target
        return dict(self.ttft_target_s).get(priority)  # type: ignore[call-overload, no-any-return]

    def budget(self, priority: str, tenant_target: float | None = None) -> float:
        """The shorter of such a request's target and max_wait_s (max_wait_s without one)."""
        target = self.target(priority, tenant_target)
        return self.max_wait_s if target is None else min(self.max_wait_s, target)


class PredictionConfig(Section):
    """How predicted mode sizes a reservation (`kvgate.admission.prediction`, docs/admission.md)."""

    # lookahead: the prompt plus what the answer has written plus at most `lookahead_tokens`
    # (less when answers of its shape are shorter). occupancy: the prompt plus the length
    # answers of its shape that got this far reach on average (the survival curve), so the
    # ledger holds the replica's expected occupancy at the answers' ends.
    rule: Literal["lookahead", "occupancy"] = "occupancy"
    quantile: float = Field(0.95, gt=0, le=1)  # "likely": this quantile of known answers
    min_samples: PositiveInt = 16  # answers a shape needs before its own history is used
    # The answer length assumed before any answer of the fleet is known (then the model's,
    # the shape's): a typical chat answer, not the worst case, so a fresh start serves as
    # much as a warm one; an answer that outruns it grows its reservation.
    prior_tokens: PositiveInt = 256


class AdmissionConfig(Section):
    enabled: bool = True  # False: forward at once, reserve nothing
    # predicted: reserve prompt + the output answers shaped like this one are likely to need
    # (`prediction`), grow the reservation as the answer grows, and let each replica's own
    # metrics steer how much is overcommitted. worst_case: reserve prompt + max_tokens, so vLLM
    # never has to preempt (the guarantee, at a cost in throughput).
    mode: AdmissionMode = "predicted"
    # predicted mode keeps a reservation at least this far ahead of what its answer has
    # written, growing it as the answer grows: the ledger follows what requests really hold,
    # as vLLM's own allocator does, plus a margin for the next moments of decoding.
    lookahead_tokens: PositiveInt = 64
    prediction: PredictionConfig = PredictionConfig()
    # A share of each replica's limit that only the critical class may use, kept while any
    # tenant is critical: a burst of lower classes is admitted up to the rest, so a critical
    # request finds room at once.
    critical_headroom: float = Field(0.1, ge=0, lt=1)
    # Per priority class, e.g. {critical: worst_case}; a tenant's admission_mode wins over both.
    class_modes: dict[PriorityClass, AdmissionMode] = {}
    # Admit while reserved + this request ≤ target_utilization × num_gpu_blocks.
    target_utilization: float = Field(0.9, gt=0, le=1)
    # Hold admission to a replica whose scraped vllm:num_requests_waiting exceeds this.
    max_replica_waiting: int = Field(4, ge=0)
    # A replica whose vLLM refused a request as busy (503 at --max-num-queued-reqs/-tokens)
    # takes no more from this instance than it held then, until one of them ends or this long.
    busy_backoff_s: PositiveFloat = 1.0
    queue: QueueConfig = QueueConfig()
    lease_ttl_s: PositiveFloat = 30.0


class CalibrationConfig(Section):
    # Bounds of the fitted tokens-per-text-token ratio; equal bounds pin it.
    min_ratio: PositiveFloat = 0.8
    max_ratio: PositiveFloat = 1.5
    # No estimate falls more than this below the raw count (the tokenizer's count plus the
    # template overhead), however the fit extrapolates: one block at vLLM's default size.
    max_undercount_tokens: int = Field(16, ge=0)
    # Once warm, a count this many times above or below the estimate is not learned from.
    outlier_factor: float = Field(3.0, gt=1.0)

    @model_validator(mode="after")
    def _ratio_range(self) -> CalibrationConfig:
        if self.min_ratio > self.max_ratio:
            raise ValueError(
                f"min_ratio ({self.min_ratio}) must not exceed max_ratio ({self.max_ratio})"
            )
        return self
