"""`slogate check --config FILE`: validate a config as `serve` would and print it resolved —
environment overrides applied, defaults filled in, secrets as `***`."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

SECRET_KEYS = {"sha256", "api_key", "password", "secret", "token"}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _mask_url(value: str) -> str:
    try:
        parts = urlsplit(value)
    except ValueError:
        return value
    if parts.password is None and parts.username is None:
        return value
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def plain(obj: Any, key: str = "") -> Any:
    """The config as plain data (dicts, lists, scalars), secrets masked."""
    if key in SECRET_KEYS and obj:
        return "***"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name), f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        if obj and all(isinstance(k, str) and _HEX64.match(k) for k in obj):
            return [plain(v) for v in obj.values()]  # keyed by a secret's hash: list them
        return {str(k): plain(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [plain(v) for v in obj]
    if isinstance(obj, str) and "://" in obj:
        return _mask_url(obj)
    return obj


def _flat_policy(policy: dict[str, Any]) -> dict[str, Any]:
    """A tenant policy as the keys one writes in [[auth.keys]] / [auth]: the ones that differ
    from the defaults (quotas flattened)."""
    from gateway.config import TenantPolicy

    default = plain(TenantPolicy())
    out: dict[str, Any] = {}
    for name, value in policy.items():
        if name == "any_class":
            continue
        if name == "quotas":
            out.update({k: v for k, v in value.items() if v != default["quotas"][k]})
        elif value != default[name]:
            out[name] = value
    return out


def as_written(data: dict[str, Any]) -> dict[str, Any]:
    """The plain config in the file's own layout (what `load` reads back): policies flattened
    into [auth] and each key, the SLO classes as top-level [[slo_classes]], the error-keyed
    fallbacks as [fallbacks.context_length]."""
    data = dict(data)
    data["auth"] = _flat_auth(data["auth"])
    slo = dict(data["slo"])
    data["slo_classes"] = list(slo.pop("classes").values())
    data["slo"] = slo
    by_error = data.pop("context_fallbacks")
    if by_error:
        data["fallbacks"] = {**data["fallbacks"], "context_length": by_error}
    return data


def _flat_auth(auth: dict[str, Any]) -> dict[str, Any]:
    """[auth] as written: each key's policy flattened into it; open mode's in [auth] itself."""
    auth = dict(auth)
    auth["keys"] = [{**{k: v for k, v in key.items() if k != "policy"},
                     **_flat_policy(key["policy"])} for key in auth.get("keys", [])]
    open_policy = auth.pop("open_policy", None)
    if auth.get("mode") == "open" and open_policy is not None:
        auth.update(_flat_policy(open_policy))
    if not auth["keys"]:
        del auth["keys"]
    if not auth.get("admin_keys"):
        auth.pop("admin_keys", None)
    return auth


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()
                                if x is not None) + " }" if v else "{}"
    return json.dumps(str(v))


def _table(lines: list[str], name: str, table: dict[str, Any], header: str) -> None:
    lines.append("")
    lines.append(header)
    for k, v in table.items():
        if v is None:
            lines.append(f"# {_key(k)} = (not set)")
            continue
        line = f"{_key(k)} = {_value(v)}"
        if k == "api_key_env" and isinstance(v, str):
            line += "  # " + ("set in the environment" if os.environ.get(v)
                              else "NOT set in the environment")
        lines.append(line)


def to_toml(data: dict[str, Any]) -> str:
    lines = ["# slogate: resolved config (environment overrides applied, defaults filled in, "
             "secrets as ***)"]
    for section, value in data.items():
        if isinstance(value, dict):
            subtables = {k: v for k, v in value.items()
                         if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)
                         or isinstance(v, dict) and v and all(isinstance(x, dict)
                                                               for x in v.values())}
            flat = {k: v for k, v in value.items() if k not in subtables}
            _table(lines, section, flat, f"[{_key(section)}]")
            for k, v in subtables.items():
                items = v if isinstance(v, list) else list(v.values())
                for item in items:
                    _table(lines, k, item, f"[[{_key(section)}.{_key(k)}]]")
        elif isinstance(value, list) and all(isinstance(x, dict) for x in value):
            for item in value:
                _table(lines, section, item, f"[[{_key(section)}]]")
        else:
            lines.append(f"{_key(section)} = {_value(value)}")
    return "\n".join(lines) + "\n"


def run(path: str) -> int:
    from gateway import config as config_mod
    from gateway.apis import PROVIDERS

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("slogate: warning: %(message)s"))
    log = logging.getLogger("slogate.config")
    log.addHandler(handler)
    log.propagate = False
    try:
        cfg = config_mod.load(path, providers=PROVIDERS)
    except config_mod.ConfigError as e:
        print(f"slogate: {e}", file=sys.stderr)
        return 2
    finally:
        log.removeHandler(handler)
    data = as_written(plain(cfg))
    sys.stdout.write(to_toml(data))
    for line in infeasible_targets(cfg, probe_backends(cfg)):
        print(f"slogate: warning: {line}", file=sys.stderr)
    print(f"slogate: {path}: config OK ({len(cfg.backends)} backend"
          f"{'s' if len(cfg.backends) != 1 else ''})", file=sys.stderr)
    return 0


# -- targets no engine can meet ----------------------------------------------------------------

SIM_CONFIG_PATH = "/sim/config"  # the built-in simulator says its physics here
PROBE_TIMEOUT_S = 1.0


def sim_floor_ms(knobs: Mapping[str, Any], prompt_tokens: int = 1) -> float:
    """The simulator's unloaded TTFT for a prompt of `prompt_tokens` (its forced stall, the
    prefill, the step that yields the first token) plus one more decode step: no target below
    it can be met even by a request alone on the engine."""
    step = float(knobs["decode_base_ms"]) + float(knobs["decode_per_seq_ms"])
    prefill = prompt_tokens / float(knobs["prefill_tokens_per_s"]) * 1e3
    return float(knobs.get("stall_ms", 0.0)) + prefill + 2 * step


def engine_physics(base_url: str) -> dict[str, Any] | None:
    """The simulator's knobs from GET <origin>/sim/config, or None when the backend is not
    the simulator (or does not answer within PROBE_TIMEOUT_S)."""
    import urllib.request

    parts = urlsplit(base_url)
    try:
        with urllib.request.urlopen(f"{parts.scheme}://{parts.netloc}{SIM_CONFIG_PATH}",
                                    timeout=PROBE_TIMEOUT_S) as r:
            knobs = json.loads(r.read())
    except (OSError, ValueError):
        return None
    need = ("decode_base_ms", "decode_per_seq_ms", "prefill_tokens_per_s")
    return knobs if isinstance(knobs, dict) and all(k in knobs for k in need) else None


def infeasible_targets(cfg: Any, physics: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """Warnings for SLO classes whose TTFT target is below what an unloaded engine takes
    (`physics`: backend name -> the simulator's knobs, None for an engine whose physics the
    gateway cannot know), and one note naming the backends it could not judge."""
    out = []
    for name, knobs in physics.items():
        if knobs is None:
            continue
        floor = sim_floor_ms(knobs)
        for cls in cfg.slo.classes.values():
            if cls.ttft_ms < floor:
                out.append(f"SLO class {cls.name!r}: ttft_ms = {cls.ttft_ms:g} is below what "
                           f"backend {name!r} takes unloaded for a 1-token prompt plus one "
                           f"decode step ({floor:.1f} ms; {sim_floor_ms(knobs, 1000):.1f} ms "
                           "at 1000 prompt tokens): no request of this class can meet it")
    unknown = sorted(name for name, knobs in physics.items() if knobs is None)
    if out and unknown:
        out.append(f"backends {', '.join(unknown)}: their unloaded TTFT is not known to the "
                   "gateway (not the simulator); measure it with `slogate bench --engine URL`")
    return out


def probe_backends(cfg: Any) -> dict[str, dict[str, Any] | None]:
    """Each backend's physics, asked concurrently (each at most PROBE_TIMEOUT_S). Only an
    OpenAI-format engine over plain http may be the simulator: a provider of another type, or
    a hosted API (https), is not asked."""
    from concurrent.futures import ThreadPoolExecutor

    backends = cfg.backends
    if not backends:
        return {}
    maybe_sim = [b.type == "openai" and b.provider in ("", "openai", "vllm")
                 and b.base_url.startswith("http://") for b in backends]
    with ThreadPoolExecutor(max_workers=min(8, len(backends))) as pool:
        found = pool.map(lambda bm: engine_physics(bm[0].base_url) if bm[1] else None,
                         zip(backends, maybe_sim, strict=True))
        return {b.name: k for b, k in zip(backends, found, strict=True)}


def warn_infeasible(path: str) -> None:
    """At `serve`'s start: log each infeasible target once as a WARNING (in the background:
    an engine that is slow to answer does not delay the gateway)."""
    import threading

    def work() -> None:
        from gateway import config as config_mod

        try:
            cfg = config_mod.load(path)
        except config_mod.ConfigError:
            return  # serve reports it
        for line in infeasible_targets(cfg, probe_backends(cfg)):
            logging.getLogger("slogate.config").warning("%s", line)

    threading.Thread(target=work, name="slogate-feasibility", daemon=True).start()
