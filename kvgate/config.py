"""The YAML configuration: schema, validation with errors that name the key path, `${ENV}`
interpolation, secret masking, and command-line overrides.

Validated once, frozen afterwards. A bad file is refused whole: at start the process exits
non-zero; on SIGHUP the old configuration stays in force (see `kvgate.app`).

Over 500 lines on purpose: every section's schema is here, in the order of
config/kvgate.yaml, so that the file a user edits and the code that checks it read alike
(the normalizer's section is its own module, `kvgate.normalize.config`).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvgate.normalize.config import NormalizationConfig, NormalizationOverride

PRIORITY_CLASSES = ("critical", "standard", "sheddable")
PriorityClass = Literal["critical", "standard", "sheddable"]
PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class ConfigError(ValueError):
    """The configuration is invalid; `problems` lists `path: message` lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL")
    if "@" in parts.netloc:
        # a replica's id is its host:port, sent to clients (X-Kvgate-Replica), in metric labels
        # and in logs: credentials there would leak everywhere
        raise ValueError("a replica URL may not carry credentials; use api_key")
    return value.rstrip("/")


class AdminConfig(_Model):
    """/admin/* and /metrics: see kvgate.api.admin."""

    # SHA-256 (hex) of the admin token; the token itself never appears in config.
    token_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # /admin/* needs the token; null: whenever auth.mode is not none.
    require_token: bool | None = None
    # A listener of their own for /admin/* and /metrics (null: on the API listener).
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=0, le=65535)


class ServerConfig(_Model):
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
    # config/kvgate.yaml and kvgate.api.routes.access_line; the metrics count every request).
    access_log: bool = False
    # X-Kvgate-Prompt-Tokens (kvgate's estimate of vLLM's count) and X-Kvgate-Reserved-Blocks
    # on every forwarded response, to compare with the usage vLLM reports.
    accounting_headers: bool = True
    admin: AdminConfig = AdminConfig()


class TimeoutsConfig(_Model):
    """Seconds. `first_byte_s` runs from sending the request to the response headers;
    `idle_s` is the longest gap between two streamed chunks; `total_s` bounds the whole call."""

    connect_s: PositiveFloat = 5.0
    first_byte_s: PositiveFloat = 120.0
    idle_s: PositiveFloat = 60.0
    total_s: PositiveFloat = 900.0


class UpstreamConfig(_Model):
    max_connections: PositiveInt = 1024
    max_connections_per_replica: PositiveInt = 256
    keepalive_s: PositiveFloat = 60.0


class ReplicaConfig(_Model):
    url: str
    name: str | None = None
    api_key: SecretStr | None = None
    # Overrides for what discovery reads from the replica's /metrics and /v1/models.
    num_gpu_blocks: PositiveInt | None = None
    block_size: PositiveInt | None = None
    max_model_len: PositiveInt | None = None
    # Take no new requests (in-flight ones finish; sessions bound here are rebound), as
    # `POST /admin/replicas/{id}/drain` does at run time.
    drain: bool = False

    _check_url = field_validator("url")(classmethod(lambda cls, v: _http_url(v)))

    @property
    def id(self) -> str:
        return self.name or urlsplit(self.url).netloc


class DnsConfig(_Model):
    """Replicas found by resolving a name (a Kubernetes headless Service lists one address per
    ready pod), re-resolved every `interval_s`; an address that disappears is drained."""

    name: str = Field(min_length=1)
    port: int = Field(8000, ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    interval_s: PositiveFloat = 10.0


class PoolConfig(_Model):
    replicas: list[ReplicaConfig] = []
    dns: DnsConfig | None = None
    # A request goes to the pool with the highest threshold its worst case reaches.
    min_worst_case_tokens: int = Field(0, ge=0)
    # Pool to try when this one has no healthy replica with capacity for the request.
    overflow_to: str | None = None

    @model_validator(mode="after")
    def _has_replicas(self) -> PoolConfig:
        if not self.replicas and self.dns is None:
            raise ValueError("a pool needs replicas, a dns name, or both")
        return self


class TokenizerConfig(_Model):
    kind: Literal["tiktoken", "huggingface"] = "tiktoken"
    encoding: str = "cl100k_base"
    file: Path | None = None
    # The model's chat template: a tokenizer_config.json (its `chat_template`) or a .jinja file.
    # For a huggingface tokenizer, the tokenizer_config.json beside `file` is used if present.
    # With it, chat prompts are counted exactly as vLLM renders them.
    template_file: Path | None = None


class ChatTemplateConfig(_Model):
    """The starting point of the calibrated estimate when kvgate does not have the model's own
    template; refined online from each replica's reported prompt_tokens. The defaults are a
    ChatML template whose markers are single special tokens: <|im_start|>, role, newline,
    <|im_end|>, newline per message; <|im_start|>assistant and a newline to open the reply."""

    tokens_per_message: int = Field(5, ge=0)
    tokens_per_name: int = Field(1, ge=0)
    reply_primer_tokens: int = Field(3, ge=0)


class ModelConfig(_Model):
    name: str = Field(min_length=1)
    tokenizer: TokenizerConfig = TokenizerConfig()
    chat_template: ChatTemplateConfig = ChatTemplateConfig()
    default_max_tokens: PositiveInt = 1024
    # Lowers the max_model_len the replicas report (used as is where they report none).
    max_model_len: PositiveInt | None = None
    # Tokens reserved for each non-text content part (an image, audio, a file): their true
    # cost depends on the model's encoder and the input's size, which kvgate cannot see.
    media_part_tokens: int = Field(1024, ge=0)
    normalization: NormalizationOverride | None = None  # over the global normalization


AdmissionMode = Literal["predicted", "worst_case"]


class QueueConfig(_Model):
    max_depth: PositiveInt = 512
    max_wait_s: PositiveFloat = 30.0  # no request waits longer, whatever its class
    # How long a request of each class may wait for KV capacity before it is better refused
    # (its latency target would be missed anyway): one that cannot start within its budget is
    # refused at once with Retry-After, not after waiting it out. Capped by max_wait_s.
    wait_budget_s: dict[PriorityClass, PositiveFloat] = {
        "critical": 30.0, "standard": 2.0, "sheddable": 1.0,
    }

    def budget(self, priority: str) -> float:
        budget = dict(self.wait_budget_s).get(priority)  # type: ignore[call-overload]
        return self.max_wait_s if budget is None else min(self.max_wait_s, float(budget))


class AdmissionConfig(_Model):
    enabled: bool = True  # False: forward at once, reserve nothing
    # predicted: reserve prompt + the output this tenant's answers are likely to need (a high
    # quantile of recent completions), grow the reservation as the answer grows, and let each
    # replica's preemptions steer how much is overcommitted. worst_case: reserve prompt +
    # max_tokens, so vLLM never has to preempt (the guarantee, at a cost in throughput).
    mode: AdmissionMode = "predicted"
    # predicted mode reserves at most this much of an answer ahead of what it has written, and
    # grows the reservation to stay that far ahead: the ledger follows what requests really
    # hold, as vLLM's own allocator does, plus a margin for the next moments of decoding.
    lookahead_tokens: PositiveInt = 64
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


class CalibrationConfig(_Model):
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


class DiscoveryConfig(_Model):
    interval_s: PositiveFloat = 2.0
    timeout_s: PositiveFloat = 1.0
    # Scraped figures older than this are treated as unknown.
    stale_after_s: PositiveFloat = 10.0


SessionSource = Literal["header", "user", "conversation"]


class SessionsConfig(_Model):
    """Sticky sessions: a request with a session key goes where the key is bound (in the state
    store, shared by every instance), while that replica can take it."""

    # Where the key comes from, first found wins: the `header`, the body's `user` field, or a
    # hash of the conversation's first `conversation_messages` messages (so a multi-turn chat
    # that resends its history lands where that history is cached).
    sources: list[SessionSource] = ["header", "user", "conversation"]
    header: str = "X-Session-Id"
    conversation_messages: PositiveInt = 2
    ttl_s: PositiveFloat = 1800.0  # refreshed on every use
    # How long a request waits for its bound replica to have room before it is rebound.
    affinity_wait_s: float = Field(0.25, ge=0)


class RetryConfig(_Model):
    """A request whose replica failed before any byte reached the client is sent once more to
    another replica (never after streaming began): its blocks are given back on the first and
    reserved on the second (it may wait there like any request); the tenant is charged once."""

    attempts: int = Field(1, ge=0, le=5)  # extra attempts; 0: never retry
    on_timeout: bool = False  # also after first_byte_s passed (the replica may still be working)


class CircuitConfig(_Model):
    failure_threshold: PositiveInt = 3  # consecutive failures that open the circuit
    open_s: PositiveFloat = 10.0  # then one trial request is let through


class RoutingConfig(_Model):
    # Scorers by name with their weights; each scores a replica in [0, 1] and the replica with
    # the highest weighted sum is tried first (admission takes the first that fits). Names:
    # session, prefix_affinity, least_loaded, round_robin.
    scorers: dict[str, Annotated[float, Field(ge=0)]] = {
        "session": 4.0, "prefix_affinity": 2.0, "least_loaded": 1.0,
    }
    # Bounded load: an affinity (a session's replica, a prefix's replica) is honoured while that
    # replica would hold at most (1 + load_factor) × its capacity-weighted fair share of the
    # pool's reserved blocks; beyond, the request goes elsewhere (and its session is rebound).
    load_factor: float = Field(0.25, ge=0)
    # ...unless it holds less than this share of its admissible blocks: then every affinity is
    # honoured (a light load has nothing to balance).
    load_floor: float = Field(0.1, ge=0, le=1)
    sessions: SessionsConfig = SessionsConfig()
    retry: RetryConfig = RetryConfig()
    circuit: CircuitConfig = CircuitConfig()

    @field_validator("scorers")
    @classmethod
    def _some_scorer(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("name at least one scorer")
        return value


class TenantConfig(_Model):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    # SHA-256 (hex) of each API key; the keys themselves never appear in config.
    api_key_sha256: list[str] = []
    tokens_per_minute: PositiveInt | None = None
    requests_per_minute: PositiveInt | None = None
    max_concurrent: PositiveInt | None = None
    max_context_tokens: PositiveInt | None = None
    max_tokens_cap: PositiveInt | None = None
    priority: PriorityClass = "standard"
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


class AuthConfig(_Model):
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


class StateConfig(_Model):
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


class Config(_Model):
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
        shortest = min(self.admission.queue.budget(c) for c in PRIORITY_CLASSES)
        if hold and hold >= shortest:
            problems.append(
                f"routing.sessions.affinity_wait_s: {hold:g}s must be shorter than the shortest "
                f"queue wait budget ({shortest:g}s), or a session's request times out waiting"
            )
        if problems:
            raise ValueError(_CROSS_REFERENCES + "\n".join(problems))
        return self

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        return self.default_model

    def tenant(self, name: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.name == name), None)


# The config in force now, as one accessor: how the background stages (discovery, DNS, the
# drain watch, the queue dispatchers, the lease keeper, the gauges) and the state every
# request shares (a pool's queue, the circuits) read a setting, each time they need it. A
# request's own stages read the snapshot it started with instead (`kvgate.runtime.Runtime`).
CurrentConfig = Callable[[], Config]


# ---------------------------------------------------------------- loading


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(tree: Any, env: Mapping[str, str]) -> Any:
    """Replace `${VAR}` / `${VAR:-default}` in every string of a parsed YAML tree; every
    variable that is unset and has no default is reported, each with its key path."""
    problems: list[str] = []
    out = _interpolate(tree, env, "", problems)
    if problems:
        raise ConfigError(problems)
    return out


def _interpolate(tree: Any, env: Mapping[str, str], path: str, problems: list[str]) -> Any:
    if isinstance(tree, dict):
        return {k: _interpolate(v, env, _join(path, k), problems) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_interpolate(v, env, f"{path}[{i}]", problems) for i, v in enumerate(tree)]
    if not isinstance(tree, str):
        return tree

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        problems.append(f"{path or '<root>'}: environment variable {name} is not set")
        return match.group(0)

    return _ENV.sub(substitute, tree)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "function_", "model-")):
            out = _join(out, part)
    return out or "<root>"


# Marks a model-level error whose lines already name their key paths.
_CROSS_REFERENCES = "cross-references:\n"


def _problems(error: Mapping[str, Any]) -> list[str]:
    message = _message(error)
    if message.startswith(_CROSS_REFERENCES):
        return message.removeprefix(_CROSS_REFERENCES).split("\n")
    return [f"{_location(tuple(error['loc']))}: {message}"]


def _message(error: Mapping[str, Any]) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key"
    if error["type"] == "missing":
        return "required"
    message = str(error["msg"])
    return message.removeprefix("Value error, ")


def parse_config(tree: Any, env: Mapping[str, str] | None = None) -> Config:
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(["<root>: must be a mapping"])
    tree = interpolate(tree, os.environ if env is None else env)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError([p for e in exc.errors() for p in _problems(e)]) from None


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    return parse_config(read_tree(path), env)


LONG_THRESHOLD = 16384  # worst-case tokens from which `--long-upstream` replicas serve


def quick_config(
    upstreams: list[str], long_upstreams: list[str] | None = None, redis_url: str | None = None
) -> dict[str, Any]:
    """The config tree `kvgate serve --upstream URL ...` runs with when no file is given."""
    tree: dict[str, Any] = {"pools": {"default": {"replicas": [{"url": u} for u in upstreams]}}}
    if long_upstreams:
        tree["pools"]["long"] = {
            "replicas": [{"url": u} for u in long_upstreams],
            "min_worst_case_tokens": LONG_THRESHOLD,
        }
    if redis_url:
        tree["state"] = {"backend": "redis", "redis_url": redis_url}
    return tree


def apply_overrides(
    tree: dict[str, Any],
    *,
    upstreams: list[str] | None = None,
    long_upstreams: list[str] | None = None,
    long_threshold: int | None = None,
    redis_url: str | None = None,
    host: str | None = None,
    port: int | None = None,
) -> dict[str, Any]:
    """Command-line flags win over the file."""
    tree = dict(tree)
    pools = dict(tree.get("pools") or {})
    if upstreams:
        name = next(iter(pools), "default") if pools else "default"
        pools[name] = {**dict(pools.get(name) or {}), "replicas": [{"url": u} for u in upstreams]}
    if long_upstreams:
        long_pool = dict(pools.get("long") or {"min_worst_case_tokens": LONG_THRESHOLD})
        long_pool["replicas"] = [{"url": u} for u in long_upstreams]
        pools["long"] = long_pool
    if long_threshold is not None:
        if "long" not in pools:
            raise ConfigError(["--long-threshold: there is no long pool (add --long-upstream)"])
        pools["long"] = {**dict(pools["long"]), "min_worst_case_tokens": long_threshold}
    if pools:
        tree["pools"] = pools
    if redis_url:
        tree["state"] = {**dict(tree.get("state") or {}), "backend": "redis", "redis_url": redis_url}
    server = dict(tree.get("server") or {})
    if host is not None:
        server["host"] = host
    if port is not None:
        server["port"] = port
    if server:
        tree["server"] = server
    return tree


def read_tree(path: str | Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: {exc.strerror or exc}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError([f"{path}: must be a mapping"])
    return tree


def masked(config: Config) -> dict[str, Any]:
    """The resolved config as plain data, with every secret replaced by '***'."""
    data = config.model_dump(mode="json")
    if config.state.redis_url is not None:  # the URL shows, its password does not
        data["state"]["redis_url"] = secret(config.state.redis_url)

    def mask(node: Any, key: str = "") -> Any:
        if isinstance(node, dict):
            return {k: mask(v, k) for k, v in node.items()}
        if isinstance(node, list):
            return [mask(v, key) for v in node]
        if key in ("api_key", "redis_url") and node:
            return "***" if key == "api_key" else _mask_url(str(node))
        return node

    return mask(data)  # type: ignore[no-any-return]


def _mask_url(url: str) -> str:
    """`redis://user:pw@host/0` -> `redis://user:***@host/0`; a `password=` query too. All
    before the last '@' counts as userinfo, so a password with a raw '/' or '@' is hidden too."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.\-]*://)(.*)@", url)
    if match:
        user, colon, _ = match.group(2).partition(":")
        userinfo = f"{user}:***" if colon else "***"
        url = f"{match.group(1)}{userinfo}@{url[match.end():]}"
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)


def secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None
