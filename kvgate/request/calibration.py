"""From counted text to vLLM's `prompt_tokens`: an affine model per model and endpoint, fitted
online from the usage every replica reports.

A chat template adds a fixed number of tokens per message (role markers, separators) and per
request (the reply primer, a BOS, a default system prompt), and a tokenizer that is not the
model's own miscounts text by some ratio. One ratio per model, as kvgate had before, cannot
fix the first kind of error: on short chat messages it was off by up to 60%, and the ratio it
learned on chats then over-counted `/v1/completions` by 19%. So the estimate is

    prompt_tokens ≈ ratio × text_tokens + per_message × messages + per_request × prompts

with `text_tokens` the tokenizer's count of the text alone (or of the fully rendered chat
template, when kvgate has the model's own), `messages` the chat messages (a tools block counts
as one) and `prompts` the prompts of a completions call (1 for a chat). Each (model, endpoint)
has its own terms, starting from a prior (the configured template overhead) and fitted by
ridge regression towards that prior over exponentially decayed sufficient statistics: O(1) per
observation, a 3×3 solve per refit (within bounds), no history kept. A young fit refits on every
observation; once it has YOUNG_FIT observations' weight, on every REFIT_EVERY-th (a solve on
every request costs the request path, and one observation in 200 barely moves the fit).
Every term stays within bounds, so no odd response can move the estimate far; the estimate is
rounded up. The ratio's bounds are the request's own `calibration` config, passed to every
call: a reload that moves them applies to requests that start after it, and refits the fit at
its next observation.

Two guards keep a fit from running away on what it has not seen. The estimate never falls
more than `max_undercount_tokens` (one block) below the raw count — the tokenizer's count
plus the configured template overhead, the prior — however the fit extrapolates: a few chats
of two or three messages cannot tell what a 300-message chat costs, and fitted alone they
once put one at 713 tokens against vLLM's 1,803. `Terms.floored` says when the raw count won,
so the gateway counts it. And once warm, a count more than `outlier_factor` away from the
estimate is not folded in (a truncated prompt, a replica behind the wrong name), unless such
counts keep coming: then the replica changed, and the fit follows.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from kvgate.config import CalibrationConfig

# Each observation's weight decays by this factor per later observation (~200-sample memory).
DECAY = 0.995
# The prior counts as this many observations; it dominates until real ones outweigh it.
PRIOR_WEIGHT = 4.0
# Refit on every observation until the fit weighs this many, then on every REFIT_EVERY-th.
YOUNG_FIT = 64.0
REFIT_EVERY = 16
PER_MESSAGE_BOUNDS = (0.0, 64.0)
PER_REQUEST_BOUNDS = (-8.0, 2048.0)
# Outliers are rejected once the fit weighs this many observations...
OUTLIER_WARM = 16.0
# ...unless this many come in a row: then the replica's counting changed, and is learned.
OUTLIER_RUN = 8


class Observed(enum.Enum):
    """What one observation did to the fit."""

    IGNORED = "ignored"  # nothing to learn from (no count)
    FOLDED = "folded"  # folded in; the terms refit later
    REFIT = "refit"  # folded in and the terms refitted
    OUTLIER = "outlier"  # too far from the estimate: left out


@dataclass(frozen=True, slots=True)
class Features:
    """What the counter saw of one request's prompt."""

    text_tokens: int
    messages: int = 0
    prompts: int = 1

    def vector(self) -> tuple[float, float, float]:
        return (float(self.text_tokens), float(self.messages), float(self.prompts))


@dataclass(frozen=True, slots=True)
class Terms:
    ratio: float = 1.0
    per_message: float = 0.0
    per_request: float = 0.0
    # The raw count's terms: no estimate falls more than `margin` tokens below them.
    floor: tuple[float, float, float] | None = None
    margin: int = 0

    def estimate(self, features: Features) -> int:
        own = _affine(self.vector(), features)
        if self.floor is None:
            return own
        return max(own, _affine(self.floor, features) - self.margin)

    def floored(self, features: Features) -> bool:
        """True when the raw count overrode the fit for these features."""
        return self.floor is not None and (
            _affine(self.vector(), features) < _affine(self.floor, features) - self.margin
        )

    def vector(self) -> tuple[float, float, float]:
        return (self.ratio, self.per_message, self.per_request)


def _affine(terms: tuple[float, float, float], features: Features) -> int:
    ratio, per_message, per_request = terms
    value = (
        ratio * features.text_tokens
        + per_message * features.messages
        + per_request * features.prompts
    )
    return max(0, math.ceil(value - 1e-6))


@dataclass(slots=True)
class _Fit:
    prior: Terms
    limits: CalibrationConfig  # the bounds `terms` was fitted within
    terms: Terms
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    weight: float = 0.0  # decayed number of observations
    error: float = 0.0  # decayed mean of (estimate − actual) / actual, before each refit
    actual_over_estimate: float = 1.0  # decayed mean, for the one-number gauge
    unfitted: int = 0  # observations folded in since the last refit
    outliers: int = 0  # observations left out, since the fit started
    outlier_run: int = 0  # outliers in a row


class Calibration:
    """The affine estimate per (model, endpoint), its ratio within `limits` (the request's
    `calibration` config). Not thread-safe; used on the event loop."""

    def __init__(self) -> None:
        self._fits: dict[tuple[str, str], _Fit] = {}

    def terms(self, model: str, endpoint: str, prior: Terms, limits: CalibrationConfig) -> Terms:
        """The terms to estimate with, floored at the raw count (`prior`, within `limits`)."""
        fit = self._fits.get((model, endpoint))
        raw = _bounded(prior, limits)
        if fit is None:
            terms = raw
        elif fit.limits is not limits:  # fitted under other bounds: held to these until refit
            terms = _bounded(fit.terms, limits)
        else:
            terms = fit.terms
        return replace(terms, floor=raw.vector(), margin=limits.max_undercount_tokens)

    def estimate(
        self, model: str, endpoint: str, features: Features, prior: Terms,
        limits: CalibrationConfig,
    ) -> int:
        return self.terms(model, endpoint, prior, limits).estimate(features)

    def observe(
        self, model: str, endpoint: str, features: Features, actual: int, prior: Terms,
        limits: CalibrationConfig,
    ) -> Observed:
        """Fold in one request's true `prompt_tokens`, unless it is an outlier."""
        if actual <= 0 or features.text_tokens < 0:
            return Observed.IGNORED
        fit = self._fits.get((model, endpoint))
        if fit is None or fit.prior != prior:  # a reload that changes the prior starts afresh
            fit = self._fits[(model, endpoint)] = _Fit(prior, limits, _bounded(prior, limits))
        moved = fit.limits is not limits  # a reload moved the bounds: refit within the new ones
        fit.limits = limits
        estimated = self.terms(model, endpoint, prior, limits).estimate(features)
        if fit.weight >= OUTLIER_WARM and estimated > 0:
            off = actual / estimated
            if not 1 / limits.outlier_factor <= off <= limits.outlier_factor:
                fit.outlier_run += 1
                if fit.outlier_run <= OUTLIER_RUN:
                    fit.outliers += 1
                    return Observed.OUTLIER
            else:
                fit.outlier_run = 0
        fit.error = _decayed(fit.error, (estimated - actual) / actual, fit.weight)
        if estimated > 0:
            fit.actual_over_estimate = _decayed(
                fit.actual_over_estimate, actual / estimated, fit.weight
            )
        x = features.vector()
        for i in range(3):
            fit.xy[i] = DECAY * fit.xy[i] + x[i] * actual
            for j in range(3):
                fit.xx[i][j] = DECAY * fit.xx[i][j] + x[i] * x[j]
        fit.weight = DECAY * fit.weight + 1.0
        fit.unfitted += 1
        if fit.weight >= YOUNG_FIT and fit.unfitted < REFIT_EVERY and not moved:
            return Observed.FOLDED
        fit.terms, fit.unfitted = _refit(fit), 0
        return Observed.REFIT

    def outliers(self, model: str, endpoint: str) -> int:
        """Observations left out as outliers since the fit started."""
        fit = self._fits.get((model, endpoint))
        return 0 if fit is None else fit.outliers

    def error(self, model: str, endpoint: str) -> float | None:
        """Recent mean of (estimate − actual) / actual: negative means under-counting."""
        fit = self._fits.get((model, endpoint))
        return None if fit is None else fit.error

    def ratio(self, model: str) -> float:
        """Recent actual ÷ estimate over the model's endpoints (1.0 when nothing is known)."""
        fits = [f for (m, _), f in self._fits.items() if m == model]
        if not fits:
            return 1.0
        total = sum(f.weight for f in fits)
        return sum(f.actual_over_estimate * f.weight for f in fits) / total

    def items(self) -> Iterator[tuple[str, str, Terms]]:
        for (model, endpoint), fit in self._fits.items():
            yield model, endpoint, fit.terms


def _refit(fit: _Fit) -> Terms:
    """Ridge regression towards the prior: (XᵀX + Λ) θ = Xᵀy + Λ θ₀, with Λ scaled to each
    feature's mean square so that whatever the units the prior weighs PRIOR_WEIGHT
    observations at first and fades as observations come (a ridge that kept its weight
    would bias a well-determined fit); it still settles what the data leave open (all
    chats with two messages cannot tell per_message from per_request)."""
    n = max(fit.weight, 1e-9)
    prior = fit.prior.vector()
    a = [row[:] for row in fit.xx]
    b = fit.xy[:]
    fading = PRIOR_WEIGHT * PRIOR_WEIGHT / (PRIOR_WEIGHT + n)
    for i in range(3):
        strength = fading * max(fit.xx[i][i] / n, 1.0)
        a[i][i] += strength
        b[i] += strength * prior[i]
    return _solve_bounded(a, b, fit.terms, fit.limits)


def _solve_bounded(
    a: list[list[float]], b: list[float], fallback: Terms, limits: CalibrationConfig
) -> Terms:
    """Minimise the ridge objective within the bounds: the exact solve when it lands inside
    them (the usual case), else projected coordinate descent from there — exact for this
    strictly convex problem, where clamping each term alone could leave a combination far
    from the best one within bounds."""
    bounds = ((limits.min_ratio, limits.max_ratio), PER_MESSAGE_BOUNDS, PER_REQUEST_BOUNDS)
    solved = _solve(a, b)
    x = list(fallback.vector()) if solved is None else solved
    if solved is not None and all(lo <= v <= hi for v, (lo, hi) in zip(x, bounds, strict=True)):
        return Terms(x[0], x[1], x[2])
    x = [min(hi, max(lo, v)) for v, (lo, hi) in zip(x, bounds, strict=True)]
    for _ in range(500):
        moved = 0.0
        for i in range(3):
            if a[i][i] <= 0:
                continue
            rest = b[i] - sum(a[i][j] * x[j] for j in range(3) if j != i)
            lo, hi = bounds[i]
            value = min(hi, max(lo, rest / a[i][i]))
            if hi > lo:  # a pinned term (min_ratio == max_ratio) never moves
                moved = max(moved, abs(value - x[i]) / (hi - lo))
            x[i] = value
        if moved < 1e-9:
            break
    return Terms(x[0], x[1], x[2])


def _bounded(terms: Terms, limits: CalibrationConfig) -> Terms:
    return Terms(
        min(limits.max_ratio, max(limits.min_ratio, terms.ratio)),
        min(PER_MESSAGE_BOUNDS[1], max(PER_MESSAGE_BOUNDS[0], terms.per_message)),
        min(PER_REQUEST_BOUNDS[1], max(PER_REQUEST_BOUNDS[0], terms.per_request)),
    )


def _decayed(mean: float, sample: float, weight: float) -> float:
    """A running mean whose memory is the same ~1/(1 − DECAY) observations as the fit's."""
    w = DECAY * weight
    return (mean * w + sample) / (w + 1.0)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a small linear system by Gaussian elimination with partial pivoting; None if it
    is singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out
