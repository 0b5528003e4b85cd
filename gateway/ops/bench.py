"""`slogate bench`: capacity planning. Offered load is swept (multiples of the engine's
capacity) through a gateway running the config, admission off unless `--set` turns it on, in
front of the built-in simulator (default) or a real engine; per load and class it prints
goodput, P99 TTFT and whether the class's targets held, then what it recommends: up to which
load each class's targets are feasible, and the [admission] max_concurrency that keeps the
engine at its knee (Little's law: the goodput there times the mean time a request that met its
SLO spent in the system)."""
from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
import tempfile
import tomllib
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from gateway.errors import ConfigError
from gateway.ops import demo, loadgen, replay

FEASIBLE = 0.9  # a class's targets hold at a load when this share of its requests met them
PROMPT, OUTPUT = (150, 250), (32, 160)  # the default mix: uniform prompt and output tokens


def sim_capacity(knobs: Mapping[str, Any]) -> float:
    """Requests/s the simulator's step model serves with a full batch B, for the default mix:
    per request, E[out] * (decode_base / B + decode_per_seq) + E[prompt] / prefill rate."""
    e_prompt, e_out = sum(PROMPT) / 2, sum(OUTPUT) / 2
    b = float(knobs["max_batch"])
    per_req = (e_out * (float(knobs["decode_base_ms"]) / b + float(knobs["decode_per_seq_ms"]))
               / 1e3 + e_prompt / float(knobs["prefill_tokens_per_s"]))
    return 1.0 / per_req


async def _sim_knobs(sim_args: Sequence[str]) -> dict[str, Any]:
    """Start a simulator with these arguments just long enough to read its GET /sim/config."""
    with tempfile.TemporaryDirectory(prefix="slogate-bench-") as tmp:
        stack = replay.Stack(Path(tmp))
        port = demo.free_port()
        try:
            p = stack.start(["sim", "--port", str(port), *sim_args], "sim")
            url = f"http://127.0.0.1:{port}"

            await demo.wait_ready(f"{url}/health", p.poll)
            with urllib.request.urlopen(f"{url}/sim/config", timeout=5) as r:
                knobs: dict[str, Any] = orjson.loads(r.read())
            return knobs
        finally:
            stack.stop()


def knees(points: Sequence[tuple[float, Mapping[str, Any]]],
          classes: Sequence[str]) -> dict[str, float | None]:
    """Per class, the highest load at which its targets held (FEASIBLE of its requests met
    them) at that load and every lower one; None when they held at none."""
    out: dict[str, float | None] = {}
    for c in classes:
        knee = None
        for load, s in sorted(points, key=lambda p: p[0]):
            part = s["classes"].get(c)
            if not part or not part["requests"] or part["met"] / part["requests"] < FEASIBLE:
                break
            knee = load
        out[c] = knee
    return out


def recommend(points: Sequence[tuple[float, Mapping[str, Any]]], classes: Sequence[str],
              capacity: float, targets: Mapping[str, tuple[float, float]]) -> list[str]:
    lines = []
    by_load = dict(points)
    k = knees(points, classes)
    for c in classes:
        ttft, tpot = targets.get(c, (math.nan, math.nan))
        load = k[c]
        if load is None:
            low = min(by_load)
            p99 = by_load[low]["classes"].get(c, {}).get("ttft_p99_ms")
            lines.append(f"- {c} (TTFT {ttft:g} ms, TPOT {tpot:g} ms): not feasible at any "
                         f"load tested (at {low:g}x, P99 TTFT {replay.fmt(p99)} ms): relax the "
                         "targets or add capacity")
        else:
            lines.append(f"- {c} (TTFT {ttft:g} ms, TPOT {tpot:g} ms): feasible up to "
                         f"{load:g}x capacity ({load * capacity:.1f} req/s offered)")
    held = [v for v in k.values() if v is not None]
    if held:
        knee = min(held)
        s = by_load[knee]
        concurrency = max(1, math.ceil(s["goodput_rps"] * (s["e2e_mean_ms"] or 0.0) / 1e3))
        lines.append(f"- knee: {knee:g}x ({s['goodput_rps']:.1f} req/s of goodput); "
                     f"[admission] enabled = true, max_concurrency = {concurrency} "
                     "(goodput x mean E2E of the requests that met their SLO there)")
    return lines


def render(points: Sequence[tuple[float, Mapping[str, Any]]], classes: Sequence[str],
           capacity: float) -> str:
    rows = ["| load | offered req/s | class | goodput req/s | met | TTFT p99 ms | refused |",
            "|---:|---:|---|---:|---:|---:|---:|"]
    for load, s in points:
        for c in classes:
            part = s["classes"].get(c, {"requests": 0, "met": 0, "goodput_rps": 0.0,
                                        "ttft_p99_ms": None, "refused": 0})
            share = part["met"] / part["requests"] if part["requests"] else 0.0
            rows.append(f"| {load:g}x | {load * capacity:.1f} | {c} | {part['goodput_rps']:.2f} "
                        f"| {share:.0%} | {replay.fmt(part['ttft_p99_ms'])} | "
                        f"{part['refused']} |")
    return "\n".join(rows)


def plot(points: Sequence[tuple[float, Mapping[str, Any]]], classes: Sequence[str],
         capacity: float, path: str) -> bool:
    plt = replay.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for c in classes:
        ax.plot([load * capacity for load, _ in points],
                [s["classes"].get(c, {}).get("goodput_rps", 0.0) for _, s in points], "o-",
                label=c)
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


async def bench(args: argparse.Namespace) -> tuple[list[tuple[float, dict[str, Any]]],
                                                   list[str], float, list[str]]:
    from gateway import config as config_mod

    cfg = config_mod.load(args.config)
    with open(args.config, "rb") as f:
        raw = tomllib.load(f)
    classes = args.classes.split(",") if args.classes else list(cfg.slo.classes)
    unknown = [c for c in classes if c not in cfg.slo.classes]
    if unknown:
        raise ValueError(f"--classes: {unknown[0]!r} is not a configured SLO class (one of "
                         f"{', '.join(cfg.slo.classes)})")
    targets = {c: (cfg.slo.classes[c].ttft_ms, cfg.slo.classes[c].tpot_ms) for c in classes}
    sim_args = shlex.split(args.sim_args)
    capacity = args.capacity
    if capacity is None:
        if args.engine:
            raise ValueError("--capacity REQ_PER_S is needed with --engine (the simulator's "
                             "is computed from its config)")
        capacity = sim_capacity(await _sim_knobs(sim_args))
    loads = [float(x) for x in args.loads.split(",")]
    settings = [("admission.enabled", False), *replay.parse_sets(args.set or [])]
    tenant = next((k.tenant for k in cfg.auth.keys.values()), None)
    points = []
    with tempfile.TemporaryDirectory(prefix="slogate-bench-") as tmp:
        for i, load in enumerate(loads):
            plan = [loadgen.Planned(p.t, p.prompt_tokens, p.output_tokens, p.slo_class, tenant,
                                    args.model) for p in loadgen.poisson(
                load * capacity, args.seconds, args.seed + i, PROMPT, OUTPUT,
                dict.fromkeys(classes, 1.0))]
            print(f"slogate bench: {load:g}x capacity ({load * capacity:.1f} req/s) for "
                  f"{args.seconds:g} s …", file=sys.stderr, flush=True)
            s = await replay.run_variant(raw, replay.Variant(f"load-{load:g}", settings), plan,
                                         args.engine, sim_args, 1.0, Path(tmp), args.seconds)
            points.append((load, s))
    return points, classes, capacity, recommend(points, classes, capacity, targets)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the gateway's TOML config")
    p.add_argument("--engine", help="a real engine's base URL (default: a fresh simulator per "
                   "backend and load)")
    p.add_argument("--sim-args", default="", help="arguments of `slogate sim` (quoted)")
    p.add_argument("--capacity", type=float, help="the engine's capacity in req/s that --loads "
                   "multiply (default: the simulator's, from its config)")
    p.add_argument("--classes", help="SLO classes to send, comma-separated, equal shares "
                   "(default: all configured)")
    p.add_argument("--loads", default="0.5,1,1.5,2", help="offered loads, x capacity")
    p.add_argument("--seconds", type=float, default=10.0, help="arrivals per load point")
    p.add_argument("--model", default="sim", help="the model name requests ask for")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="change the config for the sweep (default admission.enabled=false)")
    p.add_argument("--plot", help="also draw goodput per class against load (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    try:
        points, classes, capacity, advice = asyncio.run(bench(args))
    except (ValueError, OSError, RuntimeError, tomllib.TOMLDecodeError, ConfigError) as e:
        print(f"slogate bench: {e}", file=sys.stderr)
        return 2
    print(f"capacity {capacity:.2f} req/s; goodput = requests that met both SLO targets "
          "per second of arrivals\n")
    print(render(points, classes, capacity))
    print("\nrecommended:")
    print("\n".join(advice))
    if args.plot and plot(points, classes, capacity, args.plot):
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0
