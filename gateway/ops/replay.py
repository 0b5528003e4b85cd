"""`slogate replay TRACE`: try a policy before shipping it. A recorded trace (the JSON access
log, or the flight recorder's JSONL) is sent again, open loop at its recorded arrival offsets,
through a gateway running the current config and through one gateway per alternative
(`--alt "name: key=value,..."`), in front of the built-in simulator (default) or a real engine;
goodput, P99 TTFT per class and refusals are printed side by side. Each run is judged by its
gateway's own access log (the verdicts the gateway writes), the recorded run by the trace's."""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gateway.ops import check, demo, loadgen

DEFAULT_OUTPUT_TOKENS = 128  # a request whose output length nothing recorded
REFUSED = 429


@dataclass(frozen=True)
class Outcome:
    """What one request's record says happened (the trace's, or a replay gateway's log)."""

    t: float
    slo_class: str | None
    status: int | None
    verdict: str | None
    ttft_ms: float | None
    refused: bool
    e2e_ms: float | None = None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def parse_line(rec: Mapping[str, Any], bytes_per_token: int = 4) -> tuple[
        loadgen.Planned, Outcome] | None:
    """One trace line as (what to send, what happened), or None when it cannot be replayed
    (no arrival time). Access-log lines have `ms`, flight-recorder lines `ttft_ms`."""
    t = rec.get("t")
    if not isinstance(t, (int, float)):
        return None
    admission = rec.get("admission")
    decision = admission.get("decision") if isinstance(admission, dict) else None
    if isinstance(rec.get("ms"), dict):  # the access log
        ttft, e2e = rec["ms"].get("ttft"), rec["ms"].get("e2e")
        estimate = (_int(rec.get("body_bytes")) or 0) // bytes_per_token or None
    else:  # the flight recorder
        ttft, e2e = rec.get("ttft_ms"), None
        estimate = _int(rec.get("estimated_prompt_tokens"))
    prompt = _int(rec.get("prompt_tokens")) or estimate or 256
    output = (_int(rec.get("completion_tokens")) or _int(rec.get("max_tokens"))
              or DEFAULT_OUTPUT_TOKENS)
    status = _int(rec.get("status"))
    planned = loadgen.Planned(float(t), prompt, max(1, output), rec.get("slo_class"),
                              rec.get("tenant"), str(rec.get("model") or "sim"),
                              bool(rec.get("stream", True)))
    outcome = Outcome(float(t), rec.get("slo_class"), status, rec.get("verdict"),
                      float(ttft) if isinstance(ttft, (int, float)) else None,
                      status == REFUSED or decision == "rejected",
                      float(e2e) if isinstance(e2e, (int, float)) else None)
    return planned, outcome


def load_trace(path: str) -> tuple[list[loadgen.Planned], list[Outcome]]:
    """The trace's requests, arrival offsets from its first arrival; lines that are not JSON
    records (a text access log, other log lines) are skipped."""
    pairs = []
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line.startswith(b"{"):
                continue
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(rec, dict) and (pair := parse_line(rec)) is not None:
                pairs.append(pair)
    if not pairs:
        raise ValueError(f"{path}: no request records with an arrival time `t` (a JSON access "
                         "log from this slogate, or the flight recorder's JSONL)")
    pairs.sort(key=lambda p: p[0].t)
    t0 = pairs[0][0].t
    plan = [loadgen.Planned(p.t - t0, p.prompt_tokens, p.output_tokens, p.slo_class, p.tenant,
                            p.model, p.stream) for p, _ in pairs]
    return plan, [o for _, o in pairs]


def summarize(outcomes: Sequence[Outcome], window_s: float | None = None) -> dict[str, Any]:
    """Goodput (requests that met their SLO per second of the arrival window), P99 TTFT and
    refusals, overall and per class."""
    if window_s is None:
        ts = [o.t for o in outcomes]
        window_s = max(ts) - min(ts) if ts else 0.0
    window_s = max(window_s, 1e-3)

    def part(items: list[Outcome]) -> dict[str, Any]:
        met = [o for o in items if o.verdict == "met"]
        e2e = [o.e2e_ms for o in met if o.e2e_ms is not None]
        return {"requests": len(items), "met": len(met), "goodput_rps": len(met) / window_s,
                "e2e_mean_ms": sum(e2e) / len(e2e) if e2e else None,
                "ttft_p99_ms": loadgen.pct([o.ttft_ms for o in items if o.ttft_ms is not None],
                                           0.99),
                "refused": sum(o.refused for o in items)}

    classes = sorted({o.slo_class or "-" for o in outcomes})
    return {"window_s": window_s, **part(list(outcomes)),
            "classes": {c: part([o for o in outcomes if (o.slo_class or "-") == c])
                        for c in classes}}


# -- the config a replay gateway runs ----------------------------------------------------------

def parse_value(text: str) -> Any:
    """A --set value as a TOML value (8, 0.5, true, "x", [..]), else a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(items: Iterable[str]) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{item!r}: expected key=value, e.g. admission.max_concurrency=8")
        out.append((key.strip(), parse_value(value.strip())))
    return out


def parse_alt(text: str) -> tuple[str, list[tuple[str, Any]]]:
    """`"cap8: admission.max_concurrency=8,admission.safety=1.2"` -> (name, settings)."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--alt {text!r}: expected \"name: key=value,key=value\"")
    return name.strip(), parse_sets(s for s in rest.split(",") if s.strip())


def _named(items: list[Any], name: str, where: str) -> dict[str, Any]:
    for item in items:
        if isinstance(item, dict) and item.get("name") == name:
            return item
    raise ValueError(f"--set {where}: no entry named {name!r}")


def apply_set(raw: dict[str, Any], key: str, value: Any) -> None:
    """`section.key`, `backends.NAME.key` or `slo_classes.NAME.key` in the raw config."""
    parts = key.split(".")
    if parts[0] in ("backends", "slo_classes") and len(parts) == 3:
        _named(raw.get(parts[0], []), parts[1], key)[parts[2]] = value
        return
    if len(parts) != 2:
        raise ValueError(f"--set {key}: expected section.key, backends.NAME.key or "
                         "slo_classes.NAME.key")
    raw.setdefault(parts[0], {})[parts[1]] = value


@dataclass
class Variant:
    """One gateway config of the comparison: the file's, with settings applied."""

    name: str
    settings: list[tuple[str, Any]] = field(default_factory=list)


def gateway_config(raw: Mapping[str, Any], port: int, engines: Mapping[str, str] | None,
                   settings: Sequence[tuple[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """The replay gateway's config and a throwaway key per tenant: on `port`, the JSON access
    log on, nothing exported or shared (no OTLP, no Redis, no admin listener), each backend at
    `engines[name]` (None: as configured) with the simulator's headers forwarded."""
    cfg: dict[str, Any] = orjson.loads(orjson.dumps(raw))  # a deep copy of plain data
    cfg["server"] = {**cfg.get("server", {}), "host": "127.0.0.1", "port": port,
                     "access_log": True, "access_log_format": "json", "admin_port": 0,
                     "workers": 1}
    cfg["telemetry"] = {**cfg.get("telemetry", {}), "otlp_endpoint": ""}
    cfg["admission"] = {**cfg.get("admission", {}), "redis_url": ""}
    for b in cfg.get("backends", []):
        if engines is not None:
            b["base_url"] = engines[b["name"]]
            b["forward_headers"] = sorted({*b.get("forward_headers", []), "x-sim-*"})
    keys: dict[str, str] = {}
    auth = cfg.get("auth", {})
    for k in auth.get("keys", []):
        key = f"replay-{secrets.token_urlsafe(12)}"
        k["sha256"] = hashlib.sha256(key.encode()).hexdigest()
        keys.setdefault(k.get("tenant", ""), key)
    for k in auth.get("admin_keys", []):
        k["sha256"] = hashlib.sha256(secrets.token_bytes(16)).hexdigest()
    for key_name, value in settings:
        apply_set(cfg, key_name, value)
    return cfg, keys


def child_env(raw: Mapping[str, Any]) -> dict[str, str]:
    """The environment of a replay gateway: the operator's own SLOGATE_* overrides apply, but
    not to the keys the replay sets (listen address, access log, engines)."""
    forced = {f"SLOGATE_SERVER_{k}" for k in ("HOST", "PORT", "ACCESS_LOG",
                                              "ACCESS_LOG_FORMAT", "ADMIN_PORT", "WORKERS")}
    forced |= {"SLOGATE_TELEMETRY_OTLP_ENDPOINT", "SLOGATE_ADMISSION_REDIS_URL"}
    for b in raw.get("backends", []):
        name = str(b.get("name", "")).upper().replace("-", "_")
        forced |= {f"SLOGATE_BACKEND_{name}_BASE_URL", f"SLOGATE_BACKEND_{name}_FORWARD_HEADERS"}
    return {k: v for k, v in os.environ.items() if k not in forced}


# -- one run -----------------------------------------------------------------------------------

class Stack:
    """Simulators (one per backend, unless a real engine is given) and one gateway, as
    subprocesses; their logs go to files in `tmp`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], name: str, env: Mapping[str, str] | None = None,
              stderr_to: Path | None = None) -> subprocess.Popen[bytes]:
        out = open(stderr_to or self.tmp / f"{name}.log", "wb")  # noqa: SIM115 (child owns it)
        p = subprocess.Popen([sys.executable, "-m", "gateway", *argv], stdout=out, stderr=out,
                             env=dict(env) if env is not None else None)
        out.close()
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


async def run_variant(raw: Mapping[str, Any], variant: Variant, plan: Sequence[loadgen.Planned],
                      engine: str | None, sim_args: Sequence[str], speed: float,
                      tmp: Path, window_s: float | None = None) -> dict[str, Any]:
    """Start the engines (fresh simulators, or `engine`) and a gateway with the variant's
    config, send the plan, and summarise the gateway's access log (goodput per second of
    `window_s`, default the span of the plan's arrivals)."""
    stack = Stack(tmp)
    try:
        names = [str(b.get("name")) for b in raw.get("backends", [])]
        engines: dict[str, str] | None = None
        if engine != "config":
            engines = {}
            for name in names:
                if engine:
                    engines[name] = engine
                    continue
                port = demo.free_port()
                p = stack.start(["sim", "--port", str(port), *sim_args], f"sim-{name}")
                await demo.wait_ready(f"http://127.0.0.1:{port}/health", p.poll)
                engines[name] = f"http://127.0.0.1:{port}/v1"
        port = demo.free_port()
        cfg, keys = gateway_config(raw, port, engines, variant.settings)
        path = tmp / f"gateway-{variant.name}.toml"
        path.write_text(check.to_toml(cfg))
        env = child_env(raw)
        _validate(path, env, variant.name)
        log_path = tmp / f"gateway-{variant.name}.log"
        gw = stack.start(["serve", "--config", str(path)], variant.name, env, log_path)
        try:
            await demo.wait_ready(f"http://127.0.0.1:{port}/readyz", gw.poll)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {log_path.read_text(errors='replace')[-2000:]}") from None
        by_tenant: dict[str | None, str] = {None: next(iter(keys.values()), "replay")}
        by_tenant.update(keys)
        sent = await loadgen.send_open(f"http://127.0.0.1:{port}/v1/chat/completions", plan,
                                       by_tenant, speed=speed)
        stack.stop()  # the gateway's last lines are written before it exits
        ids = {s.request_id for s in sent if s.request_id}
        pairs = [parse_line(rec) for rec in _json_lines(log_path)
                 if rec.get("request_id") in ids]
        outcomes = [pair[1] for pair in pairs if pair is not None]
        if window_s is None:
            ts = [p.t for p in plan]
            window_s = (max(ts) - min(ts) if ts else 0.0) / speed
        summary = summarize(outcomes, window_s)
        summary["unanswered"] = sum(s.status == 0 for s in sent)
        summary["late_p99_ms"] = (loadgen.pct([s.lag_s for s in sent], 0.99) or 0.0) * 1e3
        return summary
    finally:
        stack.stop()


def _validate(path: Path, env: Mapping[str, str], name: str) -> None:
    from gateway import config as config_mod
    from gateway.apis import PROVIDERS

    try:
        config_mod.load(str(path), env=env, providers=PROVIDERS)
    except config_mod.ConfigError as e:
        raise ValueError(f"config {name!r}: {e}") from None


def _json_lines(path: Path) -> Iterable[dict[str, Any]]:
    for line in path.read_bytes().splitlines():
        if line.startswith(b"{"):
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                yield rec


# -- output ------------------------------------------------------------------------------------

def fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def render(results: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table: one column per run, rows goodput, P99 TTFT per class, refusals."""
    names = list(results)
    classes = sorted({c for r in results.values() for c in r["classes"]})
    rows = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]

    def row(label: str, cell: Any) -> None:
        rows.append(f"| {label} | " + " | ".join(cell(results[n]) for n in names) + " |")

    row("goodput req/s", lambda r: f"{r['goodput_rps']:.2f} ({r['met']}/{r['requests']})")
    for c in classes:
        row(f"{c}: goodput req/s",
            lambda r, c=c: fmt(r["classes"].get(c, {}).get("goodput_rps"), ".2f"))
        row(f"{c}: TTFT p99 ms",
            lambda r, c=c: fmt(r["classes"].get(c, {}).get("ttft_p99_ms")))
    row("refused (429)", lambda r: str(r["refused"]))
    return "\n".join(rows)


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(results: Mapping[str, Mapping[str, Any]], path: str) -> bool:
    """Goodput per run as bars (needs matplotlib; False without it)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(results)
    ax.bar(names, [results[n]["goodput_rps"] for n in names])
    ax.set_ylabel("goodput (req/s)")
    ax.set_title("slogate replay")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


async def replay(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    plan, recorded = load_trace(args.trace)
    with open(args.config, "rb") as f:
        raw = tomllib.load(f)
    variants = [Variant("current", parse_sets(args.set or []))]
    for alt in args.alt or []:
        name, settings = parse_alt(alt)
        variants.append(Variant(name, [*variants[0].settings, *settings]))
    results: dict[str, dict[str, Any]] = {"recorded": summarize(recorded)}
    with tempfile.TemporaryDirectory(prefix="slogate-replay-") as tmp:
        for v in variants:
            print(f"slogate replay: {v.name}: {len(plan)} requests over "
                  f"{results['recorded']['window_s'] / args.speed:.1f} s …", file=sys.stderr,
                  flush=True)
            results[v.name] = await run_variant(raw, v, plan, args.engine,
                                                shlex.split(args.sim_args), args.speed,
                                                Path(tmp))
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the gateway's TOML config")
    p.add_argument("--engine", help="send to this engine base URL (e.g. http://10.0.0.5:8000/v1) "
                   "instead of a fresh simulator per backend; 'config': the backends as "
                   "configured")
    p.add_argument("--sim-args", default="", help="arguments of `slogate sim` (quoted), e.g. "
                   "\"--max-batch 16 --prefill-tokens-per-s 20000\"")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="change the current config (section.key, backends.NAME.key, "
                   "slo_classes.NAME.key); repeatable")
    p.add_argument("--alt", action="append", metavar='"NAME: KEY=VALUE,..."',
                   help="an alternative config to compare (the current one with these "
                   "settings); repeatable")
    p.add_argument("--speed", type=float, default=1.0, help="compress time by this factor")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--plot", help="also draw goodput per run to this PNG (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    if args.speed <= 0:
        print("slogate replay: --speed must be > 0", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        results = asyncio.run(replay(args))
    except (ValueError, OSError, RuntimeError, tomllib.TOMLDecodeError) as e:
        print(f"slogate replay: {e}", file=sys.stderr)
        return 2
    print(render(results))
    if args.json:
        Path(args.json).write_text(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())
    if args.plot and plot(results, args.plot):
        print(f"plot: {args.plot}", file=sys.stderr)
    print(f"slogate replay: done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0
