"""The configuration: its model (frozen dataclasses, defaults stated once: model.py) and how it
is loaded from TOML and the environment (load.py). The package's names are both modules' public
ones, so a caller writes `config.parse(...)` or `from gateway.config import Timeouts`."""
from gateway.config.load import OTHER_ENV, OTLP_PROTOCOLS, check_types, load, parse
from gateway.config.model import (
    DEFAULT_CLASS,
    OPEN_POLICY,
    AdminKey,
    AdmissionConfig,
    AuthConfig,
    BackendConfig,
    BreakerPolicy,
    Config,
    GatewayKey,
    Quotas,
    RecorderConfig,
    RetryPolicy,
    ServerConfig,
    SLOClass,
    SLOConfig,
    SLOTarget,
    TelemetryConfig,
    TenantPolicy,
    Timeouts,
)
from gateway.errors import ConfigError

__all__ = [
    "DEFAULT_CLASS", "OPEN_POLICY", "OTHER_ENV", "OTLP_PROTOCOLS", "AdminKey", "AdmissionConfig",
    "AuthConfig", "BackendConfig", "BreakerPolicy", "Config", "ConfigError", "GatewayKey",
    "Quotas", "RecorderConfig", "RetryPolicy", "SLOClass", "SLOConfig", "SLOTarget", "ServerConfig",
    "TelemetryConfig", "TenantPolicy", "Timeouts", "check_types", "load", "parse",
]
