"""The normalization stage of the request path: normalize → fingerprint → track drift, with
the metrics of each. The gateway calls `apply` once per request, before counting tokens.

Settings resolve per model and tenant, each level over the one below:
`normalization` ← the model's `normalization` ← the tenant's `normalization`; resolved once
per config version, model and tenant.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvgate.metrics import Metrics
from kvgate.normalize.config import NormalizationConfig, NormalizationOverride
from kvgate.normalize.edits import Tally, estimated_tokens
from kvgate.normalize.fingerprint import Tracker, fingerprint, preview
from kvgate.normalize.pipeline import CleanTexts, Settings, normalize
from kvgate.normalize.relocate import compile_patterns
from kvgate.request.parsed import ParsedRequest

if TYPE_CHECKING:
    from kvgate.config import Config, TenantConfig


class PromptStage:
    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.tracker = Tracker(clock)
        self.clean = CleanTexts()
        self._config: Config | None = None
        self._settings: dict[tuple[str, str], Settings | None] = {}
        self._unchanged = metrics.normalization_requests.labels("unchanged")
        self._modified = metrics.normalization_requests.labels("modified")

    def apply(self, parsed: ParsedRequest, tenant: TenantConfig, config: Config
              ) -> tuple[ParsedRequest, str | None]:  # fmt: skip
        """The request as it will be counted and forwarded, and its prefix fingerprint."""
        prepared = prepare(parsed, self.settings(config, parsed.model, tenant), self.clean)
        self.took(prepared, tenant, config)
        return prepared.request, prepared.fingerprint

    def took(self, prepared: Prepared, tenant: TenantConfig, config: Config) -> None:
        """Count a prepared prompt (here, or in a worker process): normalization's edits, and
        its fingerprint among the tenant's."""
        if prepared.tally is not None:
            self.record(prepared.tally)
        key = prepared.fingerprint
        if key is not None:
            fingerprints = config.normalization.fingerprints
            old = self.tracker.observe(
                tenant.name, prepared.request.model, key, fingerprints,
                lambda: prepared.preview(fingerprints.preview_chars),
            )
            if old is not None:
                self.metrics.system_prompt_changes.labels(tenant.name, prepared.request.model).inc()

    def record(self, tally: Tally) -> None:
        if not tally.edits:
            self._unchanged.inc()
            return
        self._modified.inc()
        m = self.metrics
        for rule, edits in tally.edits.items():
            m.normalization_edits.labels(rule).inc(edits)
            changed = tally.changed[rule]
            m.normalization_changed_bytes.labels(rule).inc(changed)
            m.normalization_changed_tokens.labels(rule).inc(estimated_tokens(changed))
        for pattern, moved in tally.moved.items():
            m.normalization_relocations.labels(pattern).inc(moved)

    def settings(self, config: Config, model: str, tenant: TenantConfig) -> Settings | None:
        """None: normalization is off for this model and tenant."""
        if config is not self._config:
            self._config, self._settings = config, {}
        key = (model, tenant.name)
        if key not in self._settings:
            self._settings[key] = settings_for(config, model, tenant)
        return self._settings[key]

    def export(self, config: Config) -> None:
        """The fingerprint gauges, from the tracker (called once a second, off the request
        path): requests per fingerprint for the top N and "other", distinct per tenant."""
        m, fingerprints = self.metrics, config.normalization.fingerprints
        top, other = self.tracker.top(fingerprints)
        m.fingerprint_requests.clear()
        for key, requests in top:
            m.fingerprint_requests.labels(key).set(requests)
        m.fingerprint_requests.labels("other").set(other)
        m.tenant_fingerprints.clear()
        for tenant, count in self.tracker.per_tenant(fingerprints).items():
            m.tenant_fingerprints.labels(tenant).set(count)

    def snapshot(self, config: Config) -> dict[str, Any]:
        return self.tracker.snapshot(config.normalization.fingerprints)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request's prompt normalized and fingerprinted: pure, so that a worker process may
    prepare it (then with the preview of its system prompt already cut)."""

    request: ParsedRequest  # as normalized: counted and forwarded so
    tally: Tally | None  # normalization's edits; None: normalization is off
    fingerprint: str | None
    system_preview: str | None = None

    @property
    def edited(self) -> bool:
        return self.tally is not None and bool(self.tally.edits)

    def preview(self, chars: int) -> str:
        if self.system_preview is not None:
            return self.system_preview[:chars]
        return preview(self.request, chars)


def prepare(parsed: ParsedRequest, settings: Settings | None, clean: CleanTexts | None = None
            ) -> Prepared:  # fmt: skip
    """Normalize (unless `settings` is None: off) and fingerprint a request's prompt."""
    tally = None
    if settings is not None:
        result = normalize(parsed, settings, clean)
        parsed, tally = result.request, result.tally
    return Prepared(parsed, tally, fingerprint(parsed))


def settings_for(config: Config, model: str, tenant: TenantConfig) -> Settings | None:
    return resolve(config.normalization, config.model(model).normalization, tenant.normalization)


def resolve(base: NormalizationConfig, *overrides: NormalizationOverride | None
            ) -> Settings | None:  # fmt: skip
    enabled, code_blocks, relocate = base.enabled, base.code_blocks, base.relocate
    rules: dict[str, bool] = dict(base.rules.model_dump())
    for override in overrides:
        if override is None:
            continue
        if override.enabled is not None:
            enabled = override.enabled
        for name, on in override.rules.items():
            rules[name] = on
        if override.code_blocks is not None:
            code_blocks = override.code_blocks
        if override.relocate is not None:
            relocate = override.relocate
    if not enabled:
        return None
    return Settings.of(
        (name for name, on in rules.items() if on),
        keep_code=code_blocks == "keep",
        patterns=compile_patterns(relocate),
        target=relocate.target,
    )

