"""Sizing a request for admission: the terms of vLLM's count from kvgate's, and the `Demand`
to reserve — its worst case, its shared prefix, and in predicted mode what its shape predicts
its answer to be. Pure but for the calibration and the length model it reads, and the
metrics it counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.admission.demand import Demand
from kvgate.admission.prediction import LengthModel, Shape, answer_floor
from kvgate.config import Config, TenantConfig
from kvgate.metrics import Metrics
from kvgate.request.calibration import Calibration, Terms
from kvgate.request.catalog import Bound
from kvgate.request.parsed import ParsedRequest
from kvgate.request.tokens import PromptCount
from kvgate.runtime import Runtime


def fit_of(rt: Runtime, parsed: ParsedRequest, count: PromptCount) -> tuple[Terms, str]:
    """Where the calibration of kvgate's count starts for the request (the catalog's prior),
    and the fit its count belongs to (by endpoint, and how it was counted)."""
    return (rt.catalog.prior(parsed.model, parsed.endpoint, count),
            count.fit_name(parsed.endpoint.name.lower()))


@dataclass(slots=True)
class Sizing:
    calibration: Calibration
    metrics: Metrics
    lengths: LengthModel  # observed answer lengths, by shape

    def terms(self, rt: Runtime, parsed: ParsedRequest, count: PromptCount) -> Terms:
        prior, endpoint = fit_of(rt, parsed, count)
        terms = self.calibration.terms(parsed.model, endpoint, prior, rt.config.calibration)
        if terms.floored(count.features):  # the fit would have counted it short: raw count won
            self.metrics.calibration_floored.labels(parsed.model, endpoint).inc()
        return terms

    def demand(
        self, pool: str, parsed: ParsedRequest, tenant: TenantConfig, bound: Bound,
        count: PromptCount, terms: Terms, config: Config, lane: str | None = None,
    ) -> Demand:
        """`lane`: whom the queue shares fairly among (the tenant's name where None)."""
        model = parsed.model
        # never credit more shared blocks than the text alone could hold
        prefix = Terms(min(1.0, terms.ratio), terms.per_message).estimate(count.prefix)
        return Demand(
            pool, model, bound.worst_tokens, lane or tenant.name, tenant.priority,
            prompt_tokens=bound.prompt_tokens * parsed.sequences,
            prefix_key=f"{model}:{count.prefix_key.hex()}" if count.prefix_key else None,
            prefix_tokens=prefix if count.prefix_key else 0,
            # exact ids share blocks by content (one sequence: n > 1 is counted n times)
            token_ids=count.token_ids if parsed.sequences == 1 and bound.prompts == 1 else None,
            # the request runs at most total_s once forwarded; the lease TTL is the grace
            max_hold_s=config.timeouts.total_s + config.admission.lease_ttl_s,
            first_in_vllm=(tenant.priority == "critical"
                           and config.pools[pool].scheduling_policy == "priority"),
            **self.predicted(pool, parsed, tenant, bound, config),
        )

    def predicted(
        self, pool: str, parsed: ParsedRequest, tenant: TenantConfig, bound: Bound,
        config: Config,
    ) -> dict[str, Any]:
        """In predicted mode, the `Demand` fields that size its reservation from the answer
        its shape predicts (at least what the request forces it to write), over all its
        sequences: what to reserve beyond the prompt, the margin kept ahead of the answer,
        and (rule occupancy) where an answer that got so far is expected to end. Empty in
        worst-case mode."""
        admission = config.admission
        mode = tenant.admission_mode or admission.class_modes.get(tenant.priority, admission.mode)
        if mode != "predicted":
            return {}
        settings = admission.prediction
        sequences = bound.prompts * parsed.sequences
        prediction = self.lengths.predict(
            self.shape(parsed, tenant.name, bound), bound.max_tokens,
            min_samples=settings.min_samples, prior_tokens=settings.prior_tokens,
            floor=answer_floor(parsed.body, bound.max_tokens),
        )
        self.metrics.length_predictions.labels(pool, prediction.source).inc()
        margin = min(prediction.likely(settings.quantile), admission.lookahead_tokens)
        if settings.rule == "lookahead":
            ahead = max(margin, prediction.floor)
            return {"ahead_tokens": ahead * sequences, "margin_tokens": margin * sequences}
        prompt = bound.prompt_tokens

        def forecast(written: int) -> int:
            return prompt + prediction.expected((written - prompt) // sequences) * sequences

        def alive(written: int, more: int) -> float:
            return prediction.surviving(max(0, written - prompt) // sequences, more // sequences)

        return {
            "ahead_tokens": prediction.expected() * sequences,
            "margin_tokens": margin * sequences, "forecast": forecast, "alive": alive,
        }

    def shape(self, parsed: ParsedRequest, tenant: str, bound: Bound) -> Shape:
        return Shape.of(
            tenant, parsed.model, parsed.endpoint.name.lower(), parsed.body,
            parsed.max_tokens, bound.prompt_tokens // bound.prompts,
        )
