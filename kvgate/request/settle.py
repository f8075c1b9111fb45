"""What a request cost, once it ended: the tenant's charge settled to what the replica
processed, kvgate's count calibrated by the replica's own, the answer's length learned for its
shape, and the request's TTFT and reservation efficiency observed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvgate.admission.progress import processed_tokens
from kvgate.admission.sizing import Sizing, fit_of
from kvgate.exchange import Exchange
from kvgate.request.calibration import Observed
from kvgate.tenants import Budgets
from kvgate.transport.http import HttpTransport


class Settlement:
    """Settles through `budgets`; learns through `sizing`'s calibration and answer lengths,
    counts in its metrics; `http`: the transport in use, for a replica's figures."""

    def __init__(
        self, budgets: Budgets, sizing: Sizing, http: Callable[[], HttpTransport | None]
    ) -> None:
        self.budgets, self.sizing, self.http = budgets, sizing, http
        self.calibration, self.lengths = sizing.calibration, sizing.lengths
        self.metrics = sizing.metrics

    async def settle(self, x: Exchange) -> None:
        """Correct the tenant's charge to what the replica processed in the last attempt;
        unsettled charges (nothing reached the replica) are refunded whole when the budget's
        context exits."""
        parsed, count, outcome = x.parsed, x.count, x.attempt
        usage = outcome.usage
        if usage is not None:
            # an image's true cost, or a prompt vLLM truncated, would only skew the text's fit
            if not count.media_tokens and parsed.body.get("truncate_prompt_tokens") is None:
                self.calibrate(x, usage.prompt_tokens)
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
            if outcome.done and not outcome.upstream_failed:
                sequences = x.bound.prompts * parsed.sequences
                shape = self.sizing.shape(parsed, x.tenant_name, x.bound)
                self.lengths.observe(shape, completion // sequences)
        elif outcome.caused_no_work(parsed.stream):
            return  # refunded on exit
        else:
            # the client left, the stream broke, or kvgate gave up waiting for a whole answer
            # the replica was still computing: what the replica processed until it ended
            await self.settle_unreported(x)
            return
        assert x.charge is not None  # settling runs inside the charge
        x.charged_tokens = prompt + completion
        await self.budgets.settle(x.charge, prompt, completion)

    def calibrate(self, x: Exchange, prompt_tokens: int) -> None:
        """The replica's own count of the prompt teaches the calibration of kvgate's."""
        parsed, count, rt = x.parsed, x.count, x.rt
        prior, endpoint = fit_of(rt, parsed, count)
        observed = self.calibration.observe(
            parsed.model, endpoint, count.features, prompt_tokens, prior, rt.config.calibration
        )  # its gauges follow once a second (app.calibration_gauges)
        if observed is Observed.OUTLIER:
            self.metrics.calibration_outliers.labels(parsed.model, endpoint).inc()

    async def settle_unreported(self, x: Exchange) -> None:
        """Charge what the replica processed for a request whose usage never came; for a
        whole answer, by its decode clock read once more after the answer ended."""
        http = self.http()
        if not x.attempt.counted(x.parsed.stream) and http is not None:
            await http.figures_after(x.attempt, x.rt.config.discovery.timeout_s)
        completion = processed_tokens(x.parsed, x.bound, x.attempt)
        assert x.charge is not None  # settling runs inside the charge
        x.charged_tokens = x.bound.prompt_tokens + completion
        await self.budgets.settle(x.charge, x.bound.prompt_tokens, completion)

    def observe(self, x: Exchange) -> None:
        assert x.slot is not None
        outcome, slot, ttft_s = x.attempt, x.slot, x.ttft_s
        if ttft_s is not None:
            self.metrics.ttft.labels(x.pool, x.model).observe(ttft_s)
        used = x.bound.prompt_tokens + outcome.completion_tokens()
        if outcome.usage is not None:
            used = outcome.usage.prompt_tokens + outcome.usage.completion_tokens
        block_size = slot.replica.kv_block_size
        if slot.reserved_blocks > 0:
            self.metrics.efficiency.labels(x.pool).observe(
                min(1.0, math.ceil(used / block_size) / slot.reserved_blocks)
            )
