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

BACKEND_TYPES = ("openai",)


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

    @property
    def wildcard(self) -> bool:
        return "*" in self.models

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    backends: tuple[BackendConfig, ...]


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
    unknown = set(raw) - {"server", "backends"}
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(key, raw[key], "one of the sections [server], [[backends]]")
    server = _server(raw.get("server", {}))
    backends_raw = raw.get("backends")
    if not isinstance(backends_raw, list) or not backends_raw:
        raise ConfigError("backends", backends_raw, "at least one [[backends]] table")
    backends = tuple(_backend(i, b) for i, b in enumerate(backends_raw))
    names = [b.name for b in backends]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"backends[{i}].name", name, "a name not used by another backend")
    return Config(server=server, backends=backends)


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    raw = dict(raw)
    server = dict(raw.get("server", {}))
    for key, value in env.items():
        if key.startswith("SLOGATE_SERVER_"):
            server[key[len("SLOGATE_SERVER_"):].lower()] = _toml_value(value)
    if server:
        raw["server"] = server
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
    )
