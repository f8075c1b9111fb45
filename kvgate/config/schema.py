"""The configuration's schema: every section, in the order of config/kvgate.yaml, so that the
file a user edits and the code that checks it read alike (the normalizer's section is its
own module, `kvgate.normalize.config`). Validated once, frozen afterwards; reading a file,
`${ENV}`, errors by key path, flags and masking are `kvgate.config.load`.

The admission sections are `kvgate.config.admission`, the routing sections
`kvgate.config.routing`, the pools and their replicas `kvgate.config.fleet`, what every
section is built from `kvgate.config.base`; the cross-references between sections stay here,
with `Config`.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from kvgate.config.admission import AdmissionConfig, AdmissionMode, CalibrationConfig
from kvgate.config.base import (
    CROSS_REFERENCES,
    PRIORITY_CLASSES,
    PositiveFloat,
    PositiveInt,
    PriorityClass,
    Section,
)
from kvgate.config.fleet import PoolConfig
from kvgate.config.routing import DiscoveryConfig, RoutingConfig
from kvgate.normalize.config import NormalizationConfig, NormalizationOverride


class AdminConfig(Section):
    """/admin/* and /metrics: see kvgate.api.admin."""

    # SHA-256 (hex) of the admin token; the token itself never appears in config.
    token_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # /admin/* needs the token; null: whenever auth.mode is not none.
    require_token: bool | None = None
    # A listener of their own for /admin/* and /metrics (null: on the API listener).
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=0, le=65535)


class EppTlsConfig(Section):
    """TLS on the picker's gRPC port, as the Inference Extension's reference picker serves it
    by default: with the operator's certificate and key (PEM files), else one generated at
    start (self-signed: a gateway that verifies it needs the operator's)."""

    enabled: bool = True
    cert_file: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _both_or_neither(self) -> EppTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class EppConfig(Section):
    """kvgate as the endpoint picker behind Envoy (the Gateway API Inference Extension's
    protocol, Envoy's external processing over gRPC): see kvgate.epp and docs/envoy.md."""

    # The gRPC listener Envoy's ext_proc filter calls (null: off; 0: any free port).
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=0, le=65535)
    tls: EppTlsConfig = EppTlsConfig()


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    # Messages in a chat (or prompts in a batched completion) beyond this get 400: it bounds
    # the per-message work one request can ask of kvgate.
    max_messages: PositiveInt = 4096
    # A client's header section, and then its body, must each arrive within this; an idle
    # keep-alive connection is closed after it too.
    client_timeout_s: PositiveFloat = 30.0
    # Client connections beyond this are answered 503 (code too_many_connections) and closed.
    max_connections: PositiveInt = 10000
    drain_s: float = Field(30.0, ge=0)
    # One JSON line per API request on the `kvgate.access` logger (fields and cost: see
    # config/kvgate.yaml and kvgate.request.ending.access_line; the metrics count every request).
    access_log: bool = False
    # X-Kvgate-Prompt-Tokens (kvgate's estimate of vLLM's count) and X-Kvgate-Reserved-Blocks
    # on every forwarded response, to compare with the usage vLLM reports.
    accounting_headers: bool = True
    admin: AdminConfig = AdminConfig()
    epp: EppConfig = EppConfig()


class TimeoutsConfig(Section):
    """Seconds. `first_byte_s` runs from sending the request to the response headers;
    `idle_s` is the longest gap between two streamed chunks; `total_s` bounds the whole call."""

    connect_s: PositiveFloat = 5.0
    first_byte_s: PositiveFloat = 120.0
    idle_s: PositiveFloat = 60.0
    total_s: PositiveFloat = 900.0


class UpstreamConfig(Section):
    max_connections: PositiveInt = 1024
    max_connections_per_replica: PositiveInt = 256
    keepalive_s: PositiveFloat = 60.0


class TokenizerConfig(Section):
    kind: Literal["tiktoken", "huggingface"] = "tiktoken"
    encoding: str = "cl100k_base"
    file: Path | None = None
    # tiktoken only: special tokens beyond the encoding's own, as a tokenizer.json's added
    # tokens: a rendered chat template's "<|im_start|>" is then one id, as vLLM sees it
    # (cl100k_im's ChatML markers: {"<|im_start|>": 100264, "<|im_end|>": 100265}).
    special_tokens: dict[str, int] = {}
    # The model's chat template: a tokenizer_config.json (its `chat_template`) or a .jinja file.
    # For a huggingface tokenizer, the tokenizer_config.json beside `file` is used if present.
    # With it, chat prompts are counted exactly as vLLM renders them.
    template_file: Path | None = None

    def __hash__(self) -> int:  # loaded tokenizers are shared by equal configs
        return hash((self.kind, self.encoding, self.file, self.template_file,
                     tuple(sorted(self.special_tokens.items()))))


class ChatTemplateConfig(Section):
    """The starting point of the calibrated estimate when kvgate does not have the model's own
    template; refined online from each replica's reported prompt_tokens. The defaults are a
    ChatML template whose markers are single special tokens: <|im_start|>, role, newline,
    <|im_end|>, newline per message; <|im_start|>assistant and a newline to open the reply."""

    tokens_per_message: int = Field(5, ge=0)
    tokens_per_name: int = Field(1, ge=0)
    reply_primer_tokens: int = Field(3, ge=0)


class ModelConfig(Section):
    name: str = Field(min_length=1)
    tokenizer: TokenizerConfig = TokenizerConfig()
    chat_template: ChatTemplateConfig = ChatTemplateConfig()
    # Caps the answer of a request that sends no max_tokens (forwarded as its max_tokens).
    # None: no cap, as on a bare vLLM: such a chat may run to the end of the context.
    default_max_tokens: PositiveInt | None = None
    # Lowers the max_model_len the replicas report (used as is where they report none).
    max_model_len: PositiveInt | None = None
    # Tokens reserved for each non-text content part (an image, audio, a file): their true
    # cost depends on the model's encoder and the input's size, which kvgate cannot see.
    media_part_tokens: int = Field(1024, ge=0)
    normalization: NormalizationOverride | None = None  # over the global normalization


class TenantConfig(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    # SHA-256 (hex) of each API key; the keys themselves never appear in config.
    api_key_sha256: list[str] = []
    tokens_per_minute: PositiveInt | None = None
    requests_per_minute: PositiveInt | None = None
    max_concurrent: PositiveInt | None = None
    max_context_tokens: PositiveInt | None = None
    # The most max_tokens a request may ask (more: 400); also caps the answer of a request
    # that sends none (forwarded as its max_tokens).
    max_tokens_cap: PositiveInt | None = None
    priority: PriorityClass = "standard"
    # This tenant's latency target, over its class's (admission.queue.ttft_target_s).
    ttft_target_s: PositiveFloat | None = None
    admission_mode: AdmissionMode | None = None  # None: the class's or admission.mode
    models: list[str] | None = None  # None: every model
    pools: list[str] | None = None  # None: every pool
    normalization: NormalizationOverride | None = None  # over the model's and the global

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError("each entry must be a lowercase hex SHA-256 (64 characters)")
        return value


class AuthConfig(Section):
    mode: Literal["none", "api_key", "trusted_header"] = "none"
    # With mode=none, every request is this tenant; with api_key, requests with no key are,
    # if set (otherwise 401).
    anonymous_tenant: str | None = None
    tenant_header: str = "X-Tenant-Id"
    trusted_networks: list[str] = ["127.0.0.1/32", "::1/128"]

    @field_validator("trusted_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for net in value:
            ipaddress.ip_network(net, strict=False)
        return value


class StateConfig(Section):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: SecretStr | None = None
    key_prefix: str = "kvgate"
    failure_mode: Literal["fail_open", "fail_closed"] = "fail_open"
    timeout_s: PositiveFloat = 0.25

    @model_validator(mode="after")
    def _redis_needs_url(self) -> StateConfig:
        if self.backend == "redis" and self.redis_url is None:
            raise ValueError("backend redis needs redis_url")
        return self


class Config(Section):
    server: ServerConfig = ServerConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    pools: dict[str, PoolConfig] = Field(min_length=1)
    models: list[ModelConfig] = []
    default_model: ModelConfig = ModelConfig(name="*")
    admission: AdmissionConfig = AdmissionConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    routing: RoutingConfig = RoutingConfig()
    auth: AuthConfig = AuthConfig()
    tenants: list[TenantConfig] = []
    # The Gateway API Inference Extension's objectives (`x-gateway-inference-objective`):
    # each name's class. A request runs in the lower of its tenant's class and its
    # objective's: an objective may lower a request's class, never raise it.
    objectives: dict[str, PriorityClass] = {}
    state: StateConfig = StateConfig()
    normalization: NormalizationConfig = NormalizationConfig()

    @model_validator(mode="after")
    def _cross_references(self) -> Config:
        """Every broken reference at once, one `path: problem` line each."""
        problems = []
        for name, pool in self.pools.items():
            if pool.overflow_to is not None and pool.overflow_to not in self.pools:
                problems.append(f"pools.{name}.overflow_to: no pool named {pool.overflow_to!r}")
        seen: dict[str, str] = {}
        for name, pool in self.pools.items():
            for replica in pool.replicas:
                if replica.id in seen:
                    problems.append(
                        f"pools.{name}: replica {replica.id!r} is also in pool {seen[replica.id]!r}"
                    )
                seen[replica.id] = name
        tenants = {t.name for t in self.tenants}
        if len(tenants) != len(self.tenants):
            problems.append("tenants: names must be unique")
        anonymous = self.auth.anonymous_tenant
        if anonymous is not None and anonymous not in tenants:
            problems.append(f"auth.anonymous_tenant: no tenant named {anonymous!r}")
        for tenant in self.tenants:
            for pool_name in tenant.pools or ():
                if pool_name not in self.pools:
                    problems.append(f"tenants.{tenant.name}.pools: no pool named {pool_name!r}")
        hold = self.routing.sessions.affinity_wait_s
        queue = self.admission.queue
        shortest = min(
            [queue.budget(c) for c in PRIORITY_CLASSES]
            + [queue.budget(t.priority, t.ttft_target_s) for t in self.tenants]
        )
        if hold and hold >= shortest:
            problems.append(
                f"routing.sessions.affinity_wait_s: {hold:g}s must be shorter than the shortest "
                f"latency target or max_wait_s ({shortest:g}s), or a session's request misses "
                "it waiting for its replica"
            )
        if problems:
            raise ValueError(CROSS_REFERENCES + "\n".join(problems))
        return self

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        return self.default_model

    def knows(self, model: str) -> bool:
        """The config names `model` (it may serve it before any replica says so)."""
        return any(m.name == model for m in self.models)

    def tenant(self, name: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.name == name), None)

    @functools.cached_property
    def critical_pools(self) -> frozenset[str]:
        """The pools a critical tenant may send requests to: their replicas keep headroom."""
        critical = [t for t in self.tenants if t.priority == "critical"]
        return frozenset(
            name for name in self.pools if any(t.pools is None or name in t.pools for t in critical)
        )


# The config in force now, as one accessor: how the background stages (discovery, DNS, the
# drain watch, the queue dispatchers, the lease keeper, the gauges) and the state every
# request shares (a pool's queue, the circuits) read a setting, each time they need it. A
# request's own stages read the snapshot it started with instead (`kvgate.runtime.Runtime`).
CurrentConfig = Callable[[], Config]
