"""The configuration: its schema (`schema`, with the admission and routing sections in
`admission` and `routing`, and what every section is built from in `base`) and how it is read
(`load`). Every stage imports from here."""

from kvgate.config.admission import (
    AdmissionConfig,
    CalibrationConfig,
    PredictionConfig,
    QueueConfig,
)
from kvgate.config.base import PRIORITY_CLASSES, ConfigError
from kvgate.config.fleet import (
    DnsConfig,
    InferencePoolConfig,
    KvEventsConfig,
    KvEventsEndpoints,
    PoolConfig,
    ReplicaConfig,
)
from kvgate.config.load import (
    apply_overrides,
    interpolate,
    load_config,
    masked,
    parse_config,
    quick_config,
    read_tree,
    secret,
)
from kvgate.config.routing import (
    CircuitConfig,
    DiscoveryConfig,
    RetryConfig,
    RoutingConfig,
    SessionsConfig,
)
from kvgate.config.schema import (
    AdminConfig,
    AuthConfig,
    ChatTemplateConfig,
    Config,
    CurrentConfig,
    EppConfig,
    EppTlsConfig,
    ModelConfig,
    ServerConfig,
    StateConfig,
    TenantConfig,
    TimeoutsConfig,
    TokenizerConfig,
    UpstreamConfig,
)

__all__ = [
    "PRIORITY_CLASSES", "AdminConfig", "AdmissionConfig", "AuthConfig", "CalibrationConfig",
    "ChatTemplateConfig", "CircuitConfig", "Config", "ConfigError", "CurrentConfig",
    "DiscoveryConfig", "DnsConfig", "EppConfig", "EppTlsConfig", "InferencePoolConfig", "KvEventsConfig", "KvEventsEndpoints", "ModelConfig", "PoolConfig", "PredictionConfig",
    "QueueConfig", "ReplicaConfig", "RetryConfig", "RoutingConfig", "ServerConfig",
    "SessionsConfig", "StateConfig", "TenantConfig", "TimeoutsConfig", "TokenizerConfig",
    "UpstreamConfig", "apply_overrides", "interpolate", "load_config", "masked",
    "parse_config", "quick_config", "read_tree", "secret",
]
