"""Loading the configuration: one TOML file plus environment overrides, validated at start-up
into the frozen model (gateway/config/model.py). An error names the key, the value and what
was expected.

Environment overrides (applied before validation):
  SLOGATE_SERVER_<KEY>=value             a key of [server], e.g. SLOGATE_SERVER_PORT=9000
  SLOGATE_BACKEND_<NAME>_<KEY>=value     a key of the backend with that name, e.g.
                                         SLOGATE_BACKEND_VLLM_A_BASE_URL=http://10.0.0.5:8000/v1
Names are upper-cased with `-` turned into `_`. Values are parsed as TOML values when they parse
(numbers, booleans, arrays), else taken as strings.

Secrets never live in the file: a backend names the environment variable that holds its
upstream key (`api_key_env`).

A backend's `type` names a provider of the API layer, which sits above this one: the caller
hands the provider names in (`providers`), and `check_types` checks a parsed config against
them.
"""
from __future__ import annotations

import difflib
import logging
import os
import tomllib
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from gateway.config.model import (
    DEFAULT_CLASS,
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
    TelemetryConfig,
    TenantPolicy,
    Timeouts,
)
from gateway.errors import ATTEMPT_CONTEXT_LENGTH as CONTEXT_LENGTH, ConfigError

OTLP_PROTOCOLS = ("http/protobuf", "grpc")

log = logging.getLogger("slogate.config")

# SLOGATE_* variables read by something other than the config (test and tooling knobs): not
# warned about as unknown.
OTHER_ENV = frozenset({"SLOGATE_MODEL_CACHE", "SLOGATE_KEEP_LLAMACPP_LOG",
                       "SLOGATE_KEEP_PROC_LOG"})


# -- loading -----------------------------------------------------------------------------------

def load(path: str, env: Mapping[str, str] | None = None,
         providers: Collection[str] = ()) -> Config:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("--config", path, "an existing TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", path, f"valid TOML ({e})") from None
    return parse(raw, os.environ if env is None else env, providers)


def parse(raw: dict[str, Any], env: Mapping[str, str] | None = None,
          providers: Collection[str] = ()) -> Config:
    """The config in `raw`, with `env`'s overrides. With `providers`, each backend's type must
    be one of them (without, `check_types` does that later)."""
    origins: dict[str, str] = {}  # config key -> "VARIABLE=value" it came from
    raw = _apply_env(raw, env or {}, origins)
    try:
        return _parse(raw, providers)
    except ConfigError as e:
        source = _origin(e.key, origins)
        if source is None or e.source:
            raise
        raise ConfigError(e.key, e.value, e.expected, source) from None


def check_types(cfg: Config, providers: Collection[str]) -> None:
    """Every backend's type is one of the providers the API layer has."""
    for i, b in enumerate(cfg.backends):
        if b.type not in providers:
            raise ConfigError(f"backends[{i}].type", b.type, f"one of {sorted(providers)}")


def _origin(key: str, origins: Mapping[str, str]) -> str | None:
    """The environment variable behind a config key (or behind the table holding it)."""
    for k, source in origins.items():
        if key == k or key.startswith(k + ".") or key.startswith(k + "["):
            return source
    return None


def _parse(raw: dict[str, Any], providers: Collection[str]) -> Config:
    sections = {"server", "backends", "auth", "timeouts", "retry", "breaker", "fallbacks",
                "admission", "telemetry", "slo", "slo_classes", "recorder"}
    unknown = set(raw) - sections
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(key, raw[key], "one of the sections " + ", ".join(sorted(sections))
                          + _did_you_mean(key, sections))
    default_timeouts = _timeouts("timeouts", raw.get("timeouts", {}), Timeouts())
    server = _server(raw.get("server", {}))
    telemetry = _telemetry(raw.get("telemetry", {}))
    slo = _slo(raw.get("slo", {}), raw.get("slo_classes", []))
    backends_raw = raw.get("backends")
    if not isinstance(backends_raw, list) or not backends_raw:
        raise ConfigError("backends", backends_raw, "at least one [[backends]] table")
    backends = tuple(_backend(i, b, default_timeouts, providers)
                     for i, b in enumerate(backends_raw))
    names = [b.name for b in backends]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"backends[{i}].name", name, "a name not used by another backend")
    auth = _auth(raw.get("auth"), slo.classes)
    retry = _retry(raw.get("retry", {}))
    breaker = _breaker(raw.get("breaker", {}))
    fallbacks_raw = raw.get("fallbacks", {})
    by_error: Any = {}
    if isinstance(fallbacks_raw, dict) and isinstance(fallbacks_raw.get(CONTEXT_LENGTH), dict):
        fallbacks_raw = dict(fallbacks_raw)
        by_error = fallbacks_raw.pop(CONTEXT_LENGTH)
    fallbacks = _fallbacks(fallbacks_raw, backends)
    context_fallbacks = _fallbacks(by_error, backends, f"fallbacks.{CONTEXT_LENGTH}")
    admission = _admission(raw.get("admission", {}))
    return Config(server=server, backends=backends, auth=auth, retry=retry, breaker=breaker,
                  fallbacks=fallbacks, context_fallbacks=context_fallbacks,
                  admission=admission, telemetry=telemetry, slo=slo,
                  recorder=_recorder(raw.get("recorder", {})))


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


# The keys each overridable section takes (for "did you mean" on unknown variables).
_ENV_SECTIONS: dict[str, tuple[str, ...]] = {
    "server": tuple(ServerConfig.__dataclass_fields__),
    "telemetry": tuple(TelemetryConfig.__dataclass_fields__),
    "slo": ("default", "route_classes", "allow_header_overrides", "min_ms", "max_ms"),
    "auth": ("mode",),
    "timeouts": tuple(Timeouts.__dataclass_fields__),
    "retry": tuple(RetryPolicy.__dataclass_fields__),
    "breaker": tuple(BreakerPolicy.__dataclass_fields__),
    "admission": tuple(AdmissionConfig.__dataclass_fields__),
    "recorder": tuple(RecorderConfig.__dataclass_fields__),
}


def _apply_env(raw: dict[str, Any], env: Mapping[str, str],
               origins: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply SLOGATE_* overrides; `origins` gets config key -> "VARIABLE=value". A SLOGATE_*
    variable that overrides nothing is warned about (a typo must not pass silently)."""
    origins = {} if origins is None else origins
    used: set[str] = set()
    raw = dict(raw)
    for section in _ENV_SECTIONS:
        table = dict(raw.get(section, {})) if isinstance(raw.get(section, {}), dict) else None
        if table is None:
            continue
        prefix = f"SLOGATE_{section.upper()}_"
        for key, value in env.items():
            if key.startswith(prefix):
                name = key[len(prefix):].lower()
                table[name] = _toml_value(value)
                origins[f"{section}.{name}"] = f"{key}={value}"
                used.add(key)
        if table:
            raw[section] = table
    backend_keys: list[str] = []
    if isinstance(raw.get("backends"), list):
        backends = [dict(b) if isinstance(b, dict) else b for b in raw["backends"]]
        prefixes = sorted(((f"SLOGATE_BACKEND_{_env_name(b['name'])}_", i, b)
                           for i, b in enumerate(backends)
                           if isinstance(b, dict) and isinstance(b.get("name"), str)),
                          key=lambda pb: -len(pb[0]))
        for key, value in env.items():
            # The longest matching name wins: SLOGATE_BACKEND_VLLM_A_BASE_URL is backend
            # "vllm-a"'s base_url, not backend "vllm"'s "a_base_url".
            for prefix, i, b in prefixes:
                if key.startswith(prefix):
                    name = key[len(prefix):].lower()
                    b[name] = _toml_value(value)
                    origins[f"backends[{i}].{name}"] = f"{key}={value}"
                    used.add(key)
                    break
        raw["backends"] = backends
        backend_keys = [p + k.upper() for p, _, _ in prefixes
                        for k in BackendConfig.__dataclass_fields__]
    # A backend's api_key_env may be a SLOGATE_* name: it holds a key, it overrides nothing.
    key_vars = {b.get("api_key_env") for b in raw.get("backends") or [] if isinstance(b, dict)}
    for key in sorted(env):
        if (key.startswith("SLOGATE_") and key not in used and key not in OTHER_ENV
                and key not in key_vars):
            known = [f"SLOGATE_{s.upper()}_{k.upper()}" for s, ks in _ENV_SECTIONS.items()
                     for k in ks] + backend_keys
            close = _closest(key, known, cutoff=0.8)
            hint = (f"did you mean {close}?" if close else
                    "overrides are SLOGATE_<SECTION>_<KEY> (sections: "
                    f"{', '.join(_ENV_SECTIONS)}) or SLOGATE_BACKEND_<NAME>_<KEY>")
            log.warning("environment variable %s overrides nothing and is ignored; %s",
                        key, hint)
    return raw


def _closest(name: str, known: Iterable[str], cutoff: float) -> str | None:
    """The known name a mistyped one most likely meant (for a "did you mean")."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def _did_you_mean(key: str, known: set[str]) -> str:
    close = _closest(key, known, cutoff=0.75)
    return f" (did you mean '{close}'?)" if close else ""


def _check_keys(where: str, table: dict[str, Any], allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{where}.{key}", table[key], f"one of the keys {sorted(allowed)}"
                              + _did_you_mean(str(key), allowed))


def _typed(where: str, table: dict[str, Any], key: str, kind: type[Any], default: Any,
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
    log_format = _typed("server", table, "access_log_format", str, d.access_log_format,
                        '"json" or "text"')
    if log_format not in ("json", "text"):
        raise ConfigError("server.access_log_format", log_format, '"json" or "text"')

    def seconds(key: str, positive: bool = False) -> float:
        return _seconds("server", table, key, getattr(d, key), positive)

    return ServerConfig(
        host=_typed("server", table, "host", str, d.host, "a host name or address"),
        port=port,
        max_body_bytes=max_body,
        commit=commit,
        access_log=_typed("server", table, "access_log", bool, d.access_log, "true or false"),
        access_log_format=log_format,
        drain_timeout_s=seconds("drain_timeout_s"),
        readiness_grace_s=seconds("readiness_grace_s"),
        keepalive_s=seconds("keepalive_s"),
        header_timeout_s=seconds("header_timeout_s", True),
        body_timeout_s=seconds("body_timeout_s", True),
        idle_connection_timeout_s=seconds("idle_connection_timeout_s", True),
        max_connections=_count("server", table, "max_connections", d.max_connections, 1),
        max_connections_per_client=_count("server", table, "max_connections_per_client",
                                          d.max_connections_per_client, 0),
        backlog=_count("server", table, "backlog", d.backlog, 1),
        max_event_bytes=_count("server", table, "max_event_bytes", d.max_event_bytes, 1024),
        max_response_bytes=_count("server", table, "max_response_bytes", d.max_response_bytes,
                                  1024),
        admin_port=_admin_port(table, port),
        admin_host=_host(table, "admin_host", d.admin_host),
        admin_max_connections=_count("server", table, "admin_max_connections",
                                     d.admin_max_connections, 1),
        admin_metrics=_typed("server", table, "admin_metrics", bool, d.admin_metrics,
                             "true or false"),
        admin_console=_typed("server", table, "admin_console", bool, d.admin_console,
                             "true or false"),
        console_hosts=_names(table, "console_hosts"),
        workers=_workers(table, d.workers),
    )


def _workers(table: dict[str, Any], default: int | str) -> int | str:
    value = table.get("workers", default)
    if value == "auto" or (type(value) is int and value >= 1):
        return value  # type: ignore[no-any-return]
    raise ConfigError("server.workers", value, 'an integer >= 1 or "auto"')


def _count(where: str, table: dict[str, Any], key: str, default: int, minimum: int) -> int:
    expected = f"an integer >= {minimum}"
    value: int = _typed(where, table, key, int, default, expected)
    if value < minimum:
        raise ConfigError(f"{where}.{key}", value, expected)
    return value


def _names(table: dict[str, Any], key: str) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ConfigError(f"server.{key}", value, 'a list of host names (or ["*"])')
    return tuple(value)


def _host(table: dict[str, Any], key: str, default: str) -> str:
    value: str = _typed("server", table, key, str, default, "a host name or address")
    if not value.strip():  # an empty host would listen on every interface
        raise ConfigError(f"server.{key}", value, "a host name or address")
    return value


def _admin_port(table: dict[str, Any], port: int) -> int:
    admin: int = _typed("server", table, "admin_port", int, 0,
                        "an integer port 1-65535 other than server.port, or 0 (no separate "
                        "admin listener)")
    if not 0 <= admin <= 65535 or (admin and admin == port):
        raise ConfigError("server.admin_port", admin, "an integer port 1-65535 other than "
                          "server.port, or 0 (no separate admin listener)")
    return admin


def _seconds(where: str, table: dict[str, Any], key: str, default: float,
             positive: bool = False) -> float:
    expected = "a positive number of seconds" if positive else "a number of seconds >= 0"
    value: float = _typed(where, table, key, float, default, expected)
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{where}.{key}", value, expected)
    return value


def _timeouts(where: str, table: Any, base: Timeouts) -> Timeouts:
    if not isinstance(table, dict):
        raise ConfigError(where, table, "a table of connect_s, first_token_s, idle_s, total_s")
    _check_keys(where, table, set(Timeouts.__dataclass_fields__))
    return Timeouts(**{k: _seconds(where, table, k, getattr(base, k), positive=True)
                       for k in Timeouts.__dataclass_fields__})


def _retry(table: Any) -> RetryPolicy:
    if not isinstance(table, dict):
        raise ConfigError("retry", table, "a table")
    _check_keys("retry", table, set(RetryPolicy.__dataclass_fields__))
    d = RetryPolicy()
    attempts = _typed("retry", table, "max_attempts", int, d.max_attempts, "an integer >= 1")
    if attempts < 1:
        raise ConfigError("retry.max_attempts", attempts, "an integer >= 1")
    statuses = table.get("statuses", list(d.statuses))
    if not isinstance(statuses, list) or not all(
            isinstance(c, int) and 400 <= c <= 599 for c in statuses):
        raise ConfigError("retry.statuses", statuses, "a list of HTTP status codes 400-599")
    def seconds(key: str) -> float:
        return _seconds("retry", table, key, getattr(d, key))

    budget = seconds("budget_s")  # 0: twice the request's backend's first-token deadline
    return RetryPolicy(max_attempts=attempts, backoff_base_s=seconds("backoff_base_s"),
                       backoff_max_s=seconds("backoff_max_s"),
                       retry_after_cap_s=seconds("retry_after_cap_s"), budget_s=budget,
                       statuses=tuple(statuses),
                       same_replica_first=_typed("retry", table, "same_replica_first", bool,
                                                 d.same_replica_first, "true or false"),
                       max_continuations=_count("retry", table, "max_continuations",
                                                d.max_continuations, 0),
                       hedge_budget=_ratio("retry", table, "hedge_budget", d.hedge_budget))


def _breaker(table: Any) -> BreakerPolicy:
    if not isinstance(table, dict):
        raise ConfigError("breaker", table, "a table")
    _check_keys("breaker", table, set(BreakerPolicy.__dataclass_fields__))
    failures = _typed("breaker", table, "failures", int, BreakerPolicy.failures, "an integer >= 1")
    if failures < 1:
        raise ConfigError("breaker.failures", failures, "an integer >= 1")
    return BreakerPolicy(failures=failures, cooldown_s=_seconds(
        "breaker", table, "cooldown_s", BreakerPolicy.cooldown_s, positive=True))


def _admission(table: Any) -> AdmissionConfig:
    if not isinstance(table, dict):
        raise ConfigError("admission", table, "a table")
    _check_keys("admission", table, set(AdmissionConfig.__dataclass_fields__))
    d = AdmissionConfig()

    def count(key: str, low: int = 1) -> int:
        value: int = _typed("admission", table, key, int, getattr(d, key),
                            f"an integer >= {low}")
        if value < low:
            raise ConfigError(f"admission.{key}", value, f"an integer >= {low}")
        return value

    def fraction(key: str, low: float, high: float) -> float:
        value: float = _typed("admission", table, key, float, getattr(d, key),
                              f"a number in ({low}, {high}]")
        if not low < value <= high:
            raise ConfigError(f"admission.{key}", value, f"a number in ({low}, {high}]")
        return value

    redis_url = _typed("admission", table, "redis_url", str, "", "a redis:// URL, or empty")
    if redis_url and urlsplit(redis_url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError("admission.redis_url", redis_url, "a redis:// URL, or empty")
    safety = _typed("admission", table, "safety", float, d.safety, "a number >= 0")
    if safety < 0:
        raise ConfigError("admission.safety", safety, "a number >= 0")
    slack = _typed("admission", table, "affinity_slack", float, d.affinity_slack, "a number >= 0")
    if slack < 0:
        raise ConfigError("admission.affinity_slack", slack, "a number >= 0")
    return AdmissionConfig(
        enabled=_typed("admission", table, "enabled", bool, d.enabled, "true or false"),
        max_queue=count("max_queue", 0), max_queue_tokens=count("max_queue_tokens", 0),
        max_concurrency=count("max_concurrency"), forgetting=fraction("forgetting", 0.5, 1.0),
        safety=safety,
        prefix_affinity=_typed("admission", table, "prefix_affinity", bool, d.prefix_affinity,
                               "true or false"),
        prefix_bytes=count("prefix_bytes"), affinity_slack=slack,
        engine_metrics=_typed("admission", table, "engine_metrics", bool, d.engine_metrics,
                              "true or false"),
        engine_metrics_interval_s=_seconds("admission", table, "engine_metrics_interval_s",
                                           d.engine_metrics_interval_s, positive=True),
        redis_url=redis_url, redis_share=fraction("redis_share", 0.0, 1.0),
        lease_s=_seconds("admission", table, "lease_s", d.lease_s, positive=True),
        redis_timeout_s=_seconds("admission", table, "redis_timeout_s", d.redis_timeout_s,
                                 positive=True),
        redis_pool_size=count("redis_pool_size"),
        redis_slow_ms=_milliseconds(table, "redis_slow_ms", d.redis_slow_ms),
        redis_slow_for_s=_seconds("admission", table, "redis_slow_for_s", d.redis_slow_for_s),
        adaptive_concurrency=_typed("admission", table, "adaptive_concurrency", bool,
                                    d.adaptive_concurrency, "true or false"),
        adaptive_initial=count("adaptive_initial"), adaptive_min=count("adaptive_min"),
        adaptive_tolerance=_tolerance(table, d.adaptive_tolerance),
        preemption=_typed("admission", table, "preemption", bool, d.preemption,
                          "true or false"),
    )


def _milliseconds(table: dict[str, Any], key: str, default: float) -> float:
    value: float = _typed("admission", table, key, float, default,
                          "a positive number of milliseconds")
    if value <= 0:
        raise ConfigError(f"admission.{key}", value, "a positive number of milliseconds")
    return value


def _tolerance(table: dict[str, Any], default: float) -> float:
    value: float = _typed("admission", table, "adaptive_tolerance", float, default,
                          "a number >= 1")
    if value < 1:
        raise ConfigError("admission.adaptive_tolerance", value, "a number >= 1")
    return value


def _fallbacks(table: Any, backends: tuple[BackendConfig, ...] = (),
               where: str = "fallbacks") -> dict[str, tuple[str, ...]]:
    if not isinstance(table, dict) or not all(
            isinstance(v, list) and all(isinstance(m, str) and m for m in v)
            for v in table.values()):
        raise ConfigError(where, table, 'a table of model = ["fallback model", ...]'
                          + (f" (and a [fallbacks.{CONTEXT_LENGTH}] table of the same)"
                             if where == "fallbacks" else ""))
    if backends and not any(b.wildcard for b in backends):
        # Every model named must be one a backend serves (by name or alias): a typo here
        # would only show the day every replica fails.
        served = {m for b in backends for m in (*b.models, *b.aliases)}
        for model, chain in table.items():
            for name in (model, *chain):
                if name not in served:
                    raise ConfigError(f"{where}.{model}", name,
                                      "a model served by a backend (by name or alias): "
                                      + ", ".join(sorted(served)))
    return {k: tuple(v) for k, v in table.items()}


def _backend(i: int, table: Any, default_timeouts: Timeouts,
             providers: Collection[str]) -> BackendConfig:
    where = f"backends[{i}]"
    if not isinstance(table, dict):
        raise ConfigError(where, table, "a table")
    _check_keys(where, table, set(BackendConfig.__dataclass_fields__))
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name", name, "a non-empty string")
    btype = table.get("type", "openai")
    if providers and btype not in providers:
        raise ConfigError(f"{where}.type", btype, f"one of {sorted(providers)}")
    if not isinstance(btype, str) or not btype:
        raise ConfigError(f"{where}.type", btype, "a provider name such as \"openai\"")
    base_url = table.get("base_url")
    parts = urlsplit(base_url) if isinstance(base_url, str) else None
    if (not isinstance(base_url, str) or parts is None or parts.scheme not in ("http", "https")
            or not parts.hostname):
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
    pool = _typed(where, table, "pool_size", int, BackendConfig.pool_size, "a positive integer")
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
        timeouts=_timeouts(f"{where}.timeouts", table.get("timeouts", {}), default_timeouts),
        health_path=_health_path(where, table),
        health_interval_s=_seconds(where, table, "health_interval_s", 5.0, positive=True),
        max_concurrency=_typed(where, table, "max_concurrency", int, 0,
                               "an integer >= 0 (0 = the [admission] default)"),
        rename_max_completion_tokens=_typed(where, table, "rename_max_completion_tokens", bool,
                                            False, "true or false"),
        forward_headers=_header_names(where, table, "forward_headers"),
        deny_headers=_header_names(where, table, "deny_headers"),
        continuation=_continuation(where, table),
    )


CONTINUATIONS = ("", "prefill")


def _continuation(where: str, table: dict[str, Any]) -> str:
    mode: str = _typed(where, table, "continuation", str, "", '"prefill" or ""')
    if mode not in CONTINUATIONS:
        raise ConfigError(f"{where}.continuation", mode,
                          '"prefill" (it can continue an assistant prefill) or "" (never)')
    return mode


def _header_names(where: str, table: dict[str, Any], key: str) -> tuple[str, ...]:
    """Header names, lower-cased; `x-sim-*` (a trailing `*`) names a prefix."""
    names = table.get(key, [])
    if not isinstance(names, list) or not all(
            isinstance(n, str) and n.rstrip("*") and n.isascii() and ":" not in n
            and "*" not in n[:-1] for n in names):
        raise ConfigError(f"{where}.{key}", names, 'a list of header names such as '
                          '["OpenAI-Organization"], or prefixes such as ["x-sim-*"]')
    return tuple(n.lower() for n in names)


def _health_path(where: str, table: dict[str, Any]) -> str:
    path: str = _typed(where, table, "health_path", str, "",
                       'a path such as "/health", or empty')
    if path and not path.startswith("/"):
        raise ConfigError(f"{where}.health_path", path, 'a path such as "/health", or empty')
    return path


POLICY_KEYS = {"classes", "slo_overrides", "timeout_overrides", "override_min_ms",
               "override_max_ms", "weight", "max_in_flight", "max_queued",
               "requests_per_minute", "tokens_per_minute"}


def _auth(table: Any, classes: Mapping[str, SLOClass] | None = None) -> AuthConfig:
    expected = ('[auth] with mode = "keys" and [[auth.keys]] (tenant, sha256), or mode = "open" '
                "to serve without gateway keys")
    if not isinstance(table, dict):
        raise ConfigError("auth", table, expected)
    _check_keys("auth", table, {"mode", "keys", "admin_keys"} | POLICY_KEYS)
    mode = table.get("mode")
    if mode not in ("keys", "open"):
        raise ConfigError("auth.mode", mode, expected)
    keys_raw = table.get("keys", [])
    if not isinstance(keys_raw, list) or (mode == "keys" and not keys_raw):
        raise ConfigError("auth.keys", keys_raw, "at least one [[auth.keys]] table in keys mode")
    names = classes or {}
    if mode == "keys" and set(table) & POLICY_KEYS:
        key = sorted(set(table) & POLICY_KEYS)[0]
        raise ConfigError(f"auth.{key}", table[key],
                          "a key of [[auth.keys]] (in keys mode each key carries its policy)")
    keys: dict[str, GatewayKey] = {}
    for i, k in enumerate(keys_raw):
        where = f"auth.keys[{i}]"
        if not isinstance(k, dict):
            raise ConfigError(where, k, "a table")
        _check_keys(where, k, {"tenant", "sha256", "models"} | POLICY_KEYS)
        tenant = k.get("tenant")
        if not isinstance(tenant, str) or not tenant or tenant == "other":
            raise ConfigError(f"{where}.tenant", tenant, 'a tenant name (not "other")')
        digest = _digest(where, k)
        models = k.get("models", ["*"])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ConfigError(f"{where}.models", models, 'a list of model names or ["*"]')
        keys[digest] = GatewayKey(tenant=tenant, sha256=digest, models=tuple(models),
                                  policy=_policy(where, k, names))
    admin: dict[str, AdminKey] = {}
    admin_raw = table.get("admin_keys", [])
    if not isinstance(admin_raw, list):
        raise ConfigError("auth.admin_keys", admin_raw, "a list of [[auth.admin_keys]] tables")
    for i, k in enumerate(admin_raw):
        where = f"auth.admin_keys[{i}]"
        if not isinstance(k, dict):
            raise ConfigError(where, k, "a table")
        _check_keys(where, k, {"name", "sha256"})
        name = k.get("name", f"admin-{i}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name", name, "a name for this admin key")
        digest = _digest(where, k)
        if digest in keys:
            raise ConfigError(f"{where}.sha256", "<hidden>", "a key that is not also a tenant key")
        admin[digest] = AdminKey(name=name, sha256=digest)
    open_policy = (_policy("auth", table, names, any_class=True) if mode == "open"
                   else TenantPolicy())
    return AuthConfig(mode=mode, keys=keys, open_policy=open_policy, admin_keys=admin)


def _digest(where: str, k: dict[str, Any]) -> str:
    digest = k.get("sha256")
    if (not isinstance(digest, str) or len(digest) != 64
            or any(c not in "0123456789abcdef" for c in digest.lower())):
        # Never echo what might be a real key pasted by mistake.
        raise ConfigError(f"{where}.sha256", "<hidden>",
                          "the 64-hex-digit sha256 of the key (`slogate hash-key`)")
    return digest.lower()


def _policy(where: str, k: dict[str, Any], classes: Mapping[str, SLOClass],
            any_class: bool = False) -> TenantPolicy:
    """A tenant's SLO classes, overrides, weight and quotas (a key's, or open mode's)."""
    d = TenantPolicy()
    allowed = k.get("classes", [])
    if (not isinstance(allowed, list) or not all(isinstance(c, str) for c in allowed)
            or (classes and any(c not in classes for c in allowed))):
        raise ConfigError(f"{where}.classes", allowed,
                          f"a list of SLO class names from {sorted(classes)} (the first is the "
                          "default)")
    low = _typed(where, k, "override_min_ms", float, d.override_min_ms,
                 "a positive number of milliseconds")
    high = _typed(where, k, "override_max_ms", float, d.override_max_ms,
                  "a number of milliseconds >= override_min_ms")
    if low <= 0:
        raise ConfigError(f"{where}.override_min_ms", low, "a positive number of milliseconds")
    if high < low:
        raise ConfigError(f"{where}.override_max_ms", high,
                          "a number of milliseconds >= override_min_ms")
    weight = _typed(where, k, "weight", float, d.weight, "a positive number")
    if not weight > 0:
        raise ConfigError(f"{where}.weight", weight, "a positive number")

    def quota(key: str) -> int:
        value: int = _typed(where, k, key, int, 0, "an integer >= 0 (0 = no quota)")
        if value < 0:
            raise ConfigError(f"{where}.{key}", value, "an integer >= 0 (0 = no quota)")
        return value

    return TenantPolicy(
        classes=tuple(allowed), any_class=any_class and not allowed,
        slo_overrides=_typed(where, k, "slo_overrides", bool, False, "true or false"),
        timeout_overrides=_typed(where, k, "timeout_overrides", bool, False, "true or false"),
        override_min_ms=low, override_max_ms=high, weight=weight,
        quotas=Quotas(max_in_flight=quota("max_in_flight"), max_queued=quota("max_queued"),
                      requests_per_minute=quota("requests_per_minute"),
                      tokens_per_minute=quota("tokens_per_minute")))


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
    def flag(key: str) -> bool:
        value: bool = _typed("telemetry", table, key, bool, getattr(d, key), "true or false")
        return value

    return TelemetryConfig(
        otlp_endpoint=endpoint, otlp_protocol=protocol,
        service_name=_typed("telemetry", table, "service_name", str, d.service_name,
                            "a service name"),
        traces=flag("traces"), otlp_metrics=flag("otlp_metrics"),
        metrics_export_interval_s=interval, prometheus=flag("prometheus"),
        capture_content=flag("capture_content"),
        trace_sample_ratio=_ratio("telemetry", table, "trace_sample_ratio", d.trace_sample_ratio),
        otlp_chunk_metrics=flag("otlp_chunk_metrics"),
    )


def _recorder(table: Any) -> RecorderConfig:
    if not isinstance(table, dict):
        raise ConfigError("recorder", table, "a table")
    _check_keys("recorder", table, set(RecorderConfig.__dataclass_fields__))
    d = RecorderConfig()
    path: str = _typed("recorder", table, "path", str, d.path,
                       "a file path for the decisions' JSON lines, or empty")
    if path.strip() != path or "\0" in path:
        raise ConfigError("recorder.path", path, "a file path without surrounding spaces")
    return RecorderConfig(
        enabled=_typed("recorder", table, "enabled", bool, d.enabled, "true or false"),
        ring_size=_count("recorder", table, "ring_size", d.ring_size, 1),
        path=path,
        max_bytes=_count("recorder", table, "max_bytes", d.max_bytes, 4096),
        backups=_count("recorder", table, "backups", d.backups, 0))


def _ratio(where: str, table: dict[str, Any], key: str, default: float) -> float:
    value: float = _typed(where, table, key, float, default, "a number from 0 to 1")
    if not 0 <= value <= 1:
        raise ConfigError(f"{where}.{key}", value, "a number from 0 to 1")
    return value


def _positive_ms(where: str, table: dict[str, Any], key: str, required: bool) -> float | None:
    if key not in table:
        if required:
            raise ConfigError(f"{where}.{key}", None, "a positive number of milliseconds")
        return None
    value: float = _typed(where, table, key, float, None, "a positive number of milliseconds")
    if value <= 0:
        raise ConfigError(f"{where}.{key}", value, "a positive number of milliseconds")
    return value


def _hedge_after(where: str, c: dict[str, Any]) -> float | Literal["auto"] | None:
    value = c.get("hedge_after_ms")
    if value == "auto":
        return "auto"
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or value <= 0):
        raise ConfigError(f"{where}.hedge_after_ms", value,
                          'a positive number of milliseconds, or "auto" (the live P95 TTFT)')
    return None if value is None else float(value)


def _class_weight(where: str, c: dict[str, Any]) -> float:
    value: float = _typed(where, c, "weight", float, 1.0, "a positive number")
    if not value > 0:
        raise ConfigError(f"{where}.weight", value, "a positive number")
    return value


def _slo(table: Any, classes_raw: Any) -> SLOConfig:
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
        _check_keys(where, c, {"name", "ttft_ms", "tpot_ms", "e2e_ms", "priority", "weight",
                               "min_share", "hedge_after_ms"})
        name = c.get("name")
        if not isinstance(name, str) or not name or name in classes:
            raise ConfigError(f"{where}.name", name, "a non-empty name not used by another class")
        classes[name] = SLOClass(
            name=name,
            ttft_ms=_positive_ms(where, c, "ttft_ms", True),  # type: ignore[arg-type]
            tpot_ms=_positive_ms(where, c, "tpot_ms", True),  # type: ignore[arg-type]
            e2e_ms=_positive_ms(where, c, "e2e_ms", False),
            priority=_typed(where, c, "priority", int, 0, "an integer (higher = more important)"),
            weight=_class_weight(where, c),
            min_share=_ratio(where, c, "min_share", SLOClass.min_share),
            hedge_after_ms=_hedge_after(where, c),
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
    return SLOConfig(classes=classes, default=default, route_classes=dict(routes),
                     min_ms=min_ms, max_ms=max_ms,
                     allow_header_overrides=_typed("slo", table, "allow_header_overrides", bool,
                                                   True, "true or false"))
