"""The `normalization:` section of the config, and the per-model / per-tenant override.

Defined here (not in `kvgate.config`) so that the normalizer owns its settings; this module
imports nothing from kvgate, so `kvgate.config` can import it without a cycle.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Every rule, in the order the pipeline runs them (kvgate.normalize.pipeline.RULES).
RuleName = Literal[
    "invisible_characters",
    "line_endings",
    "unicode_nfc",
    "trailing_whitespace",
    "canonical_json",
    "system_first",
    "merge_system",
    "relocate_dynamic",
]
SAFE_RULES: tuple[RuleName, ...] = (
    "invisible_characters", "line_endings", "unicode_nfc", "trailing_whitespace", "canonical_json",
)
BUILTIN_PATTERNS = ("timestamp", "date", "request_id", "user_name")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Rules(_Model):
    """Which rules run. The safe ones are on by default; the structural ones and the
    relocation of dynamic content change what the model reads, so they are opt-in."""

    invisible_characters: bool = True
    line_endings: bool = True
    unicode_nfc: bool = True
    trailing_whitespace: bool = True
    canonical_json: bool = True
    system_first: bool = False
    merge_system: bool = False
    relocate_dynamic: bool = False


class NamedPattern(_Model):
    """A regex whose matches in the system prompt are moved out of it. With a group named
    `value`, only that group moves (the words around it stay, as context)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")
    regex: str

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regex: {exc}") from None
        if compiled.search(""):
            raise ValueError("the regex matches the empty string")
        return value


class RelocationConfig(_Model):
    # Built-in names (timestamp, date, request_id, user_name) or named regexes.
    patterns: list[str | NamedPattern] = ["timestamp", "date", "request_id"]
    # last_user: appended to the last user message (a final system note if there is none);
    # system_note: a final system message after the conversation.
    target: Literal["last_user", "system_note"] = "last_user"

    @field_validator("patterns")
    @classmethod
    def _known(cls, value: list[str | NamedPattern]) -> list[str | NamedPattern]:
        names = []
        for pattern in value:
            if isinstance(pattern, str) and pattern not in BUILTIN_PATTERNS:
                raise ValueError(
                    f"unknown pattern {pattern!r}; built in: {', '.join(BUILTIN_PATTERNS)}, "
                    "or give {name, regex}"
                )
            names.append(pattern if isinstance(pattern, str) else pattern.name)
        if len(set(names)) != len(names):
            raise ValueError("pattern names must be unique")
        for pattern in value:
            if isinstance(pattern, NamedPattern):
                for name in names:
                    if re.search(pattern.regex, f"[{name}]"):
                        raise ValueError(
                            f"{pattern.name}: the regex matches the placeholder [{name}] "
                            "that replaces a moved value"
                        )
        return value


class FingerprintConfig(_Model):
    # Requests per fingerprint are exported for the busiest top_n; the rest as "other".
    top_n: int = Field(20, ge=1, le=200)
    # A fingerprint unseen this long is forgotten (and counts as new if it returns).
    window_s: float = Field(3600.0, gt=0)
    # At most this many live fingerprints in all (the least recently seen go first).
    max_tracked: int = Field(1000, ge=1)
    # /admin/prompts shows the first preview_chars characters of each system prompt: off by
    # default, since prompts may hold secrets or personal data.
    preview: bool = False
    preview_chars: int = Field(80, ge=1, le=1000)
    # At most one "system prompt changed" log line per tenant and model this often.
    log_interval_s: float = Field(60.0, ge=0)


class NormalizationConfig(_Model):
    enabled: bool = True
    rules: Rules = Rules()
    # keep: inside ``` fenced code blocks, line ends and trailing whitespace stay as sent.
    # normalize: code blocks get the same rules as the text around them.
    code_blocks: Literal["keep", "normalize"] = "keep"
    relocate: RelocationConfig = RelocationConfig()
    fingerprints: FingerprintConfig = FingerprintConfig()


class NormalizationOverride(_Model):
    """A model's or tenant's own switches, over the global ones (a tenant's win over its
    model's). Unset fields keep what the level below says."""

    enabled: bool | None = None
    rules: dict[RuleName, bool] = {}
    code_blocks: Literal["keep", "normalize"] | None = None
    relocate: RelocationConfig | None = None
