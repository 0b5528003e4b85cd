#!/usr/bin/env python3
"""Throughput with `slogate serve --workers N`: 1 vs 2 workers at 64 and 256 streams.

Uses benchmarks/overhead.py's load generator and process handling: the simulator (decode step
`--token-ms`, no prefill cost, a batch large enough for every stream), then for each worker
count the gateway (`--workers N`), and for each concurrency level a closed-loop load directly
against the simulator and then through the gateway. Nothing is pinned: the point is what the
gateway does when it may use every core, here shared with the simulator and the load
generator.

Reported per point: tokens/s direct and through the gateway (and their ratio); gateway CPU per
streamed token (utime+stime of the supervisor and every worker over the window, ÷ tokens
streamed through it); each worker's share of the requests finished in the window (from
`slogate_worker_requests_total` on /metrics, before and after); the workers' CPU.

    .venv/bin/python -m benchmarks.workers --out bench-results/workers.json \\
        --markdown bench-results/workers.md
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.overhead import (
    DEFAULT_SIM_CMD,
    Procs,
    cpu_model,
    free_port,
    gateway_config,
    git_rev,
    probe_stream,
    run_client,
    wait_http,
)


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(out)


def worker_requests(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("slogate_worker_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('"')[1]] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    ap.add_argument("--streams", default="64,256", help="concurrency levels (default 64,256)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds measured per point")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--token-ms", type=float, default=2.0)
    ap.add_argument("--out", default="bench-results/workers.json")
    ap.add_argument("--markdown")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over the worker counts, interleaved (the table shows medians "
                         "and ranges: on a shared machine one round is noisy)")
    args = ap.parse_args(argv)
    worker_counts = [int(w) for w in args.workers.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    host = args.host

    tmp = Path(tempfile.mkdtemp(prefix="slogate-bench-workers-"))
    procs = Procs(tmp)
    sim_port = free_port(host)
    max_batch = max(1024, 2 * max(streams))
    py = shlex.quote(sys.executable)
    sim_argv = shlex.split(DEFAULT_SIM_CMD.format(python=py, host=host, port=sim_port,
                                                  token_ms=f"{args.token_ms:g}",
                                                  max_batch=max_batch))
    results: dict[str, Any] = {"meta": {
        "benchmark": "workers", "git": git_rev(), "tokens": args.tokens,
        "token_ms": args.token_ms, "duration_s": args.duration, "warmup_s": args.warmup,
        "cpus": len(os.sched_getaffinity(0)), "cpu_model": cpu_model(),
        "loadavg_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "placement": "unpinned (gateway, simulator and load generator share the cores)"},
        "points": []}
    ok = False
    try:
        sim = procs.start("sim", sim_argv, None)
        wait_http(procs, "sim", f"http://{host}:{sim_port}/v1/models")
        for rnd, w in [(r, w) for r in range(args.repeat) for w in worker_counts]:
            gw_port = free_port(host)
            cfg = tmp / f"gateway-{w}.toml"
            cfg.write_text(gateway_config(host, gw_port, sim_port, max(256, 2 * max(streams)),
                                          ""))
            gw = procs.start("gateway", [sys.executable, "-m", "gateway", "serve", "--config",
                                         str(cfg), "--workers", str(w)], None)
            base = f"http://{host}:{gw_port}"
            wait_http(procs, "gateway", base + "/readyz")
            if w > 1:
                deadline = time.monotonic() + 20
                while len(children(gw.pid)) < w:
                    if time.monotonic() > deadline:
                        raise RuntimeError("workers did not start")
                    time.sleep(0.2)
                time.sleep(2)  # every worker listening
            pids = children(gw.pid) if w > 1 else []
            watch = {"sim": sim.pid, "gateway": gw.pid,
                     **{f"worker{i}": pid for i, pid in enumerate(pids)}}
            urls = {"direct": f"http://{host}:{sim_port}/v1/chat/completions",
                    "gateway": base + "/v1/chat/completions"}
            for path, url in urls.items():
                status, n = probe_stream(url, args.tokens)
                if status != 200 or n != args.tokens:
                    raise RuntimeError(f"probe via {path}: HTTP {status}, {n} events")
            for n in streams:
                point: dict[str, Any] = {"workers": w, "streams": n, "round": rnd}
                for path in ("direct", "gateway"):
                    spec = {"path": f"{path}-w{w}", "url": urls[path], "streams": n,
                            "warmup": args.warmup, "duration": args.duration,
                            "tokens": args.tokens, "token_ms": args.token_ms, "grace": 10.0,
                            "watch": watch}
                    before = worker_requests(base + "/metrics") if path == "gateway" else {}
                    r = run_client(procs, tmp, spec, None)
                    point[path] = r
                    if path == "gateway":
                        after = worker_requests(base + "/metrics")
                        served = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                        total = sum(served.values()) or 1.0
                        point["share"] = ({k: v / total for k, v in sorted(served.items())}
                                          if w > 1 else {"0": 1.0})
                g, d = point["gateway"], point["direct"]
                cpu_s = sum(c["cpu_s"] or 0.0 for name, c in g["cpu"].items()
                            if name == "gateway" or name.startswith("worker"))
                point["gateway_cpu_s"] = cpu_s
                point["gateway_cpu_util"] = cpu_s / g["window_s"]
                point["gateway_cpu_us_per_token"] = cpu_s / g["tokens"] * 1e6 if g["tokens"] \
                    else None
                point["tokens_per_s_ratio"] = g["tokens_per_s"] / d["tokens_per_s"] \
                    if d["tokens_per_s"] else None
                point["sim_cpu_util"] = g["cpu"]["sim"]["util"]
                point["client_cpu_util"] = g["cpu"]["client"]["util"]
                results["points"].append(point)
                print(f"workers {w} streams {n}: direct {d['tokens_per_s']:.0f} tok/s, gateway "
                      f"{g['tokens_per_s']:.0f} tok/s ({point['tokens_per_s_ratio']:.3f}x), "
                      f"{point['gateway_cpu_us_per_token']:.1f} us/token, gateway CPU "
                      f"{point['gateway_cpu_util'] * 100:.0f}%, share "
                      f"{ {k: round(v, 3) for k, v in point['share'].items()} }, errors "
                      f"{g['errors']}", flush=True)
            procs.procs = [(name, p) for name, p in procs.procs if p is not gw]
            os.killpg(gw.pid, 15)
            gw.wait(60)
        ok = True
    except RuntimeError as e:
        print(f"benchmark failed: {e}; logs in {tmp}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    table = render(results)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _cell(xs: list[float], fmt: str) -> str:
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(_median(xs), fmt)} ({format(min(xs), fmt)}–{format(max(xs), fmt)})"


def render(results: dict[str, Any]) -> str:
    m = results["meta"]
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for p in results["points"]:
        groups.setdefault((p["workers"], p["streams"]), []).append(p)
    rounds = max(len(g) for g in groups.values())
    lines = [f"{m['tokens']} tokens at {m['token_ms']:g} ms/token, {m['duration_s']:g} s per "
             f"point; {m['cpus']} CPUs ({m['cpu_model']}), {m['placement']}; load avg at start "
             f"{m['loadavg_start']}." + (f" {rounds} interleaved rounds: median (min–max)."
                                          if rounds > 1 else ""), "",
             "| workers | streams | direct tok/s | gateway tok/s | vs direct | gateway µs/token "
             "| gateway CPU % | share of requests per worker | sim CPU % | load gen CPU % |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for (w, n), ps in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        shares = sorted({k for p in ps for k in p["share"]})
        share = ", ".join(_cell([p["share"].get(k, 0.0) * 100 for p in ps], ".0f") + "%"
                          for k in shares)
        lines.append(
            f"| {w} | {n} | {_cell([p['direct']['tokens_per_s'] for p in ps], '.0f')} "
            f"| {_cell([p['gateway']['tokens_per_s'] for p in ps], '.0f')} "
            f"| {_cell([p['tokens_per_s_ratio'] for p in ps], '.2f')}× "
            f"| {_cell([p['gateway_cpu_us_per_token'] for p in ps], '.1f')} "
            f"| {_cell([p['gateway_cpu_util'] * 100 for p in ps], '.0f')} "
            f"| {share} | {_cell([(p['sim_cpu_util'] or 0) * 100 for p in ps], '.0f')} "
            f"| {_cell([(p['client_cpu_util'] or 0) * 100 for p in ps], '.0f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
