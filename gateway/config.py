"""Configuration: one TOML file plus environment overrides, validated at start-up.

Environment overrides (applied before validation):
  SLOGATE_SERVER_<KEY>=value             a key of [server], e.g. SLOGATE_SERVER_PORT=9000
  SLOGATE_BACKEND_<NAME>_<KEY>=value     a key of the backend with that name, e.g.
                                         SLOGATE_BACKEND_VLLM_A_BASE_URL=http://10.0.0.5:8000/v1
Names are upper-cased with `-` turned into `_`. Values are parsed as TOML values when they parse
(numbers, booleans, arrays), else taken as strings.

Secrets never live in the file: a backend names the environment variable that holds its
upstream key (`api_key_env`).
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlsplit

import backends
from gateway.auth import AuthPolicy, GatewayKey
from gateway.slo import DEFAULT_CLASS, SLOClass, SLOPolicy

BACKEND_TYPES = tuple(backends.BACKEND_TYPES)
OTLP_PROTOCOLS = ("http/protobuf", "grpc")


class ConfigError(Exception):
    """A config problem: names the key, the bad value and what was expected."""

    def __init__(self, key: str, value: Any, expected: str) -> None:
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"config error: {key} = {value!r}: expected {expected}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 16 * 1024 * 1024
    # "first_token": hold the client's response headers until the first token (so a failure
    # before it can still become a clean error); "headers": commit when upstream headers arrive.
    commit: str = "first_token"
    connect_timeout_s: float = 10.0
    access_log: bool = True  # one JSON line per finished request


@dataclass(frozen=True)
class BackendConfig:
    name: str
    type: str
    base_url: str
    models: tuple[str, ...] = ("*",)
    aliases: Mapping[str, str] = field(default_factory=dict)
    api_key_env: str | None = None
    pool_size: int = 256
    forward_client_auth: bool = False
    # Send our trace context upstream (so vLLM's span joins our trace). Off for hosted APIs:
    # it would leak internal ids to a third party.
    propagate_trace: bool = True
    # gen_ai.provider.name in telemetry (e.g. "vllm", "sglang", "openai"); defaults to the type.
    provider: str = ""

    @property
    def wildcard(self) -> bool:
        return "*" in self.models

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(frozen=True)
class TelemetryConfig:
    # OTLP endpoint for traces and metrics; empty = the standard OTEL_EXPORTER_OTLP_* variables
    # decide, and with none of them set nothing is exported.
    otlp_endpoint: str = ""
    otlp_protocol: str = "http/protobuf"
    service_name: str = "slogate"
    traces: bool = True
    otlp_metrics: bool = True
    metrics_export_interval_s: float = 15.0
    prometheus: bool = True  # GET /metrics
    capture_content: bool = False  # prompts/completions in spans: only if the operator opts in


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    backends: tuple[BackendConfig, ...]
    auth: AuthPolicy
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    slo: SLOPolicy = field(default_factory=lambda: SLOPolicy(
        classes={DEFAULT_CLASS.name: DEFAULT_CLASS}, default=DEFAULT_CLASS.name, route_classes={}))


# -- loading -----------------------------------------------------------------------------------

def load(path: str, env: Mapping[str, str] | None = None) -> Config:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("--config", path, "an existing TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", path, f"valid TOML ({e})") from None
    return parse(raw, os.environ if env is None else env)


def parse(raw: dict[str, Any], env: Mapping[str, str] | None = None) -> Config:
    raw = _apply_env(raw, env or {})
    unknown = set(raw) - {"server", "backends", "auth", "telemetry", "slo", "slo_classes"}
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(key, raw[key], "one of the sections [server], [[backends]], [auth], "
                          "[telemetry], [slo], [[slo_classes]]")
    server = _server(raw.get("server", {}))
    telemetry = _telemetry(raw.get("telemetry", {}))
    slo = _slo(raw.get("slo", {}), raw.get("slo_classes", []))
    backends_raw = raw.get("backends")
    if not isinstance(backends_raw, list) or not backends_raw:
        raise ConfigError("backends", backends_raw, "at least one [[backends]] table")
    backends = tuple(_backend(i, b) for i, b in enumerate(backends_raw))
    names = [b.name for b in backends]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"backends[{i}].name", name, "a name not used by another backend")
    auth = _auth(raw.get("auth"))
    return Config(server=server, backends=backends, auth=auth, telemetry=telemetry, slo=slo)


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    raw = dict(raw)
    for section in ("server", "telemetry", "slo", "auth"):
        table = dict(raw.get(section, {})) if isinstance(raw.get(section, {}), dict) else None
        if table is None:
            continue
        prefix = f"SLOGATE_{section.upper()}_"
        for key, value in env.items():
            if key.startswith(prefix):
                table[key[len(prefix):].lower()] = _toml_value(value)
        if table:
            raw[section] = table
    if isinstance(raw.get("backends"), list):
        backends = []
        for b in raw["backends"]:
            if isinstance(b, dict) and isinstance(b.get("name"), str):
                prefix = f"SLOGATE_BACKEND_{_env_name(b['name'])}_"
                b = dict(b)
                for key, value in env.items():
                    if key.startswith(prefix):
                        b[key[len(prefix):].lower()] = _toml_value(value)
            backends.append(b)
        raw["backends"] = backends
    return raw


def _check_keys(where: str, table: dict[str, Any], allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{where}.{key}", table[key], f"one of the keys {sorted(allowed)}")


def _typed(where: str, table: dict[str, Any], key: str, kind: type | tuple, default: Any,
           expected: str) -> Any:
    if key not in table:
        return default
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}.{key}", value, expected)
    return value


def _server(table: Any) -> ServerConfig:
    if not isinstance(table, dict):
        raise ConfigError("server", table, "a table")
    d = ServerConfig()
    _check_keys("server", table, set(ServerConfig.__dataclass_fields__))
    port = _typed("server", table, "port", int, d.port, "an integer port 0-65535")
    if not 0 <= port <= 65535:
        raise ConfigError("server.port", port, "an integer port 0-65535")
    max_body = _typed("server", table, "max_body_bytes", int, d.max_body_bytes,
                      "a positive integer (bytes)")
    if max_body <= 0:
        raise ConfigError("server.max_body_bytes", max_body, "a positive integer (bytes)")
    commit = _typed("server", table, "commit", str, d.commit, '"first_token" or "headers"')
    if commit not in ("first_token", "headers"):
        raise ConfigError("server.commit", commit, '"first_token" or "headers"')
    connect = _typed("server", table, "connect_timeout_s", float, d.connect_timeout_s,
                     "a positive number of seconds")
    if connect <= 0:
        raise ConfigError("server.connect_timeout_s", connect, "a positive number of seconds")
    return ServerConfig(
        host=_typed("server", table, "host", str, d.host, "a host name or address"),
        port=port,
        max_body_bytes=max_body,
        commit=commit,
        connect_timeout_s=connect,
        access_log=_typed("server", table, "access_log", bool, d.access_log, "true or false"),
    )


def _backend(i: int, table: Any) -> BackendConfig:
    where = f"backends[{i}]"
    if not isinstance(table, dict):
        raise ConfigError(where, table, "a table")
    _check_keys(where, table, set(BackendConfig.__dataclass_fields__))
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name", name, "a non-empty string")
    btype = table.get("type", "openai")
    if btype not in BACKEND_TYPES:
        raise ConfigError(f"{where}.type", btype, f"one of {list(BACKEND_TYPES)}")
    base_url = table.get("base_url")
    parts = urlsplit(base_url) if isinstance(base_url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}.base_url", base_url,
                          "an http(s) URL such as http://127.0.0.1:8000/v1")
    models = table.get("models", ["*"])
    if isinstance(models, str):
        models = [models]
    if (not isinstance(models, list) or not models
            or not all(isinstance(m, str) and m for m in models)):
        raise ConfigError(f"{where}.models", models, 'a list of model names, or "*"')
    aliases = table.get("aliases", {})
    if not isinstance(aliases, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in aliases.items()):
        raise ConfigError(f"{where}.aliases", aliases,
                          'a table of client model name = "upstream model name"')
    key_env = _typed(where, table, "api_key_env", str, None,
                     "the name of an environment variable holding the upstream key")
    if key_env is not None and not key_env:
        key_env = None
    pool = _typed(where, table, "pool_size", int, 256, "a positive integer")
    if pool <= 0:
        raise ConfigError(f"{where}.pool_size", pool, "a positive integer")
    return BackendConfig(
        name=name,
        type=btype,
        base_url=base_url.rstrip("/"),
        models=tuple(models),
        aliases=dict(aliases),
        api_key_env=key_env,
        pool_size=pool,
        forward_client_auth=_typed(where, table, "forward_client_auth", bool, False,
                                   "true or false"),
        propagate_trace=_typed(where, table, "propagate_trace", bool, True, "true or false"),
        provider=_typed(where, table, "provider", str, "", "a provider name such as \"vllm\"")
        or btype,
    )


def _auth(table: Any) -> AuthPolicy:
    expected = ('[auth] with mode = "keys" and [[auth.keys]] (tenant, sha256), or mode = "open" '
                "to serve without gateway keys")
    if not isinstance(table, dict):
        raise ConfigError("auth", table, expected)
    _check_keys("auth", table, {"mode", "keys"})
    mode = table.get("mode")
    if mode not in ("keys", "open"):
        raise ConfigError("auth.mode", mode, expected)
    keys_raw = table.get("keys", [])
    if not isinstance(keys_raw, list) or (mode == "keys" and not keys_raw):
        raise ConfigError("auth.keys", keys_raw, "at least one [[auth.keys]] table in keys mode")
    keys: dict[str, GatewayKey] = {}
    for i, k in enumerate(keys_raw):
        where = f"auth.keys[{i}]"
        if not isinstance(k, dict):
            raise ConfigError(where, k, "a table")
        _check_keys(where, k, {"tenant", "sha256", "models"})
        tenant = k.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"{where}.tenant", tenant, "a tenant name")
        digest = k.get("sha256")
        if (not isinstance(digest, str) or len(digest) != 64
                or any(c not in "0123456789abcdef" for c in digest.lower())):
            # Never echo what might be a real key pasted by mistake.
            raise ConfigError(f"{where}.sha256", "<hidden>",
                              "the 64-hex-digit sha256 of the key (`slogate hash-key`)")
        models = k.get("models", ["*"])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ConfigError(f"{where}.models", models, 'a list of model names or ["*"]')
        keys[digest.lower()] = GatewayKey(tenant=tenant, sha256=digest.lower(),
                                          models=tuple(models))
    return AuthPolicy(mode=mode, keys=keys)


def _telemetry(table: Any) -> TelemetryConfig:
    if not isinstance(table, dict):
        raise ConfigError("telemetry", table, "a table")
    _check_keys("telemetry", table, set(TelemetryConfig.__dataclass_fields__))
    d = TelemetryConfig()
    endpoint = _typed("telemetry", table, "otlp_endpoint", str, d.otlp_endpoint,
                      "an http(s) URL of an OTLP receiver, or empty")
    if endpoint and urlsplit(endpoint).scheme not in ("http", "https"):
        raise ConfigError("telemetry.otlp_endpoint", endpoint,
                          "an http(s) URL such as http://127.0.0.1:4318")
    protocol = _typed("telemetry", table, "otlp_protocol", str, d.otlp_protocol,
                      f"one of {list(OTLP_PROTOCOLS)}")
    if protocol not in OTLP_PROTOCOLS:
        raise ConfigError("telemetry.otlp_protocol", protocol, f"one of {list(OTLP_PROTOCOLS)}")
    interval = _typed("telemetry", table, "metrics_export_interval_s", float,
                      d.metrics_export_interval_s, "a positive number of seconds")
    if interval <= 0:
        raise ConfigError("telemetry.metrics_export_interval_s", interval,
                          "a positive number of seconds")
    flag = lambda key: _typed("telemetry", table, key, bool, getattr(d, key), "true or false")
    return TelemetryConfig(
        otlp_endpoint=endpoint, otlp_protocol=protocol,
        service_name=_typed("telemetry", table, "service_name", str, d.service_name,
                            "a service name"),
        traces=flag("traces"), otlp_metrics=flag("otlp_metrics"),
        metrics_export_interval_s=interval, prometheus=flag("prometheus"),
        capture_content=flag("capture_content"),
    )


def _positive_ms(where: str, table: dict[str, Any], key: str, required: bool) -> float | None:
    if key not in table:
        if required:
            raise ConfigError(f"{where}.{key}", None, "a positive number of milliseconds")
        return None
    value = _typed(where, table, key, float, None, "a positive number of milliseconds")
    if value <= 0:
        raise ConfigError(f"{where}.{key}", value, "a positive number of milliseconds")
    return value


def _slo(table: Any, classes_raw: Any) -> SLOPolicy:
    if not isinstance(table, dict):
        raise ConfigError("slo", table, "a table")
    _check_keys("slo", table, {"default", "route_classes", "allow_header_overrides",
                               "min_ms", "max_ms"})
    if not isinstance(classes_raw, list):
        raise ConfigError("slo_classes", classes_raw, "a list of [[slo_classes]] tables")
    classes: dict[str, SLOClass] = {}
    for i, c in enumerate(classes_raw):
        where = f"slo_classes[{i}]"
        if not isinstance(c, dict):
            raise ConfigError(where, c, "a table")
        _check_keys(where, c, {"name", "ttft_ms", "tpot_ms", "e2e_ms", "priority"})
        name = c.get("name")
        if not isinstance(name, str) or not name or name in classes:
            raise ConfigError(f"{where}.name", name, "a non-empty name not used by another class")
        classes[name] = SLOClass(
            name=name,
            ttft_ms=_positive_ms(where, c, "ttft_ms", True),  # type: ignore[arg-type]
            tpot_ms=_positive_ms(where, c, "tpot_ms", True),  # type: ignore[arg-type]
            e2e_ms=_positive_ms(where, c, "e2e_ms", False),
            priority=_typed(where, c, "priority", int, 0, "an integer (higher = more important)"),
        )
    if not classes:
        classes = {DEFAULT_CLASS.name: DEFAULT_CLASS}
    default = _typed("slo", table, "default", str, next(iter(classes)), "a configured class name")
    if default not in classes:
        raise ConfigError("slo.default", default, f"one of the classes {sorted(classes)}")
    routes = table.get("route_classes", {})
    if not isinstance(routes, dict) or any(v not in classes for v in routes.values()):
        raise ConfigError("slo.route_classes", routes,
                          f"a table of route = class name, classes: {sorted(classes)}")
    min_ms = _positive_ms("slo", table, "min_ms", False) or 1.0
    max_ms = _positive_ms("slo", table, "max_ms", False) or 600_000.0
    return SLOPolicy(classes=classes, default=default, route_classes=dict(routes),
                     min_ms=min_ms, max_ms=max_ms,
                     allow_header_overrides=_typed("slo", table, "allow_header_overrides", bool,
                                                   True, "true or false"))
