#!/usr/bin/env python3
"""Faults benchmark: P99 TTFT and goodput with one replica that stalls some first tokens, with
and without the first-token race, and the extra tokens the race costs.

Two simulator replicas of one model behind the gateway (max batch 16, decode step 10 ms +
0.5 ms per sequence, prefill 20k tokens/s): `steady`, and `staller`, whose first token comes
`--stall-ms` (2000) late on a seeded `--stall-rate` (5 %) of its requests. One SLO class, TTFT
500 ms and TPOT 100 ms. For each mode — no race, `hedge_after_ms` at each of `--after`
(default 150, 300, 600 ms) and "auto" (the class's live P95) — a fresh gateway and fresh
simulators (the same seeded stalls) take the same seeded open-loop Poisson schedule of
`--rate` requests/s for `--seconds`, 32 output tokens each, `[retry] hedge_budget = 0.1`.

Measured at the client (raw aiohttp): TTFT (request sent → first non-empty delta.content),
P50/P99; goodput = the share of requests answered in full with TTFT and TPOT within the
class's targets. From the gateway's /metrics after the run: races by result
(slogate_hedges_total), races skipped (budget, saturated) and the losers' tokens
(slogate_hedge_tokens_total), reported as extra tokens in % of the tokens the clients were
served (prompt + completion, from the usage chunks). The figure is P99 TTFT against extra
tokens, one point per mode.

    make bench-faults                       # or: python -m benchmarks.faults --seconds 30
Writes bench-results/faults.json, faults.md and faults.png (when matplotlib is present).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from gateway.ops import demo

TTFT_MS, TPOT_MS, TOKENS = 500.0, 100.0, 32
BODY = {"model": "m", "stream": True, "max_tokens": TOKENS,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "A short question about rivers, please."}]}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def gateway_toml(urls: dict[str, str], hedge: float | str | None) -> str:
    after = "" if hedge is None else f"hedge_after_ms = {json.dumps(hedge)}"
    backends = "".join(f'[[backends]]\nname = "{n}"\nbase_url = "{u}/v1"\nmodels = ["m"]\n'
                       'forward_headers = ["x-sim-output-tokens"]\n' for n, u in urls.items())
    return f"""
[auth]
mode = "open"
[server]
access_log = false
[retry]
hedge_budget = 0.1
[breaker]
failures = 1000000
[[slo_classes]]
name = "chat"
ttft_ms = {TTFT_MS}
tpot_ms = {TPOT_MS}
{after}
{backends}"""


async def one(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    t0 = time.monotonic()
    rec: dict[str, Any] = {"ok": False, "ttft": None, "tpot": None, "tokens": 0}
    stamps: list[float] = []
    try:
        async with s.post(url + "/v1/chat/completions", json=BODY,
                          headers={"x-sim-output-tokens": str(TOKENS)}) as r:
            if r.status != 200:
                await r.read()
                return rec
            buf = b""
            async for chunk in r.content.iter_any():
                now = time.monotonic()
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = event.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        rec["ok"] = True
                        continue
                    msg = json.loads(data)
                    if msg.get("usage"):
                        rec["tokens"] = msg["usage"]["total_tokens"]
                    for ch in msg.get("choices", ()):
                        if ch.get("delta", {}).get("content"):
                            stamps.append(now)
    except (TimeoutError, aiohttp.ClientError):
        return rec
    if stamps:
        rec["ttft"] = (stamps[0] - t0) * 1e3
        if len(stamps) > 1:
            rec["tpot"] = (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1)
    return rec


async def drive(url: str, rate: float, seconds: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        arrivals.append(t)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        start = time.monotonic()

        async def at(when: float) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + when - time.monotonic()))
            return await one(s, url)

        return list(await asyncio.gather(*(at(a) for a in arrivals)))


def counters(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(rf'^{name}\{{[^}}]*{label}="([^"]+)"[^}}]*\}} (\S+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_mode(hedge: float | str | None, args: argparse.Namespace,
                   logs: Path) -> dict[str, Any]:
    py = sys.executable
    ports = {"steady": free_port(), "staller": free_port()}
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    gw_port = free_port()
    gw_url = f"http://127.0.0.1:{gw_port}"
    cfg = Path(tempfile.mkstemp(suffix=".toml")[1])
    cfg.write_text(gateway_toml(urls, hedge))
    procs: list[subprocess.Popen[bytes]] = []
    tag = "off" if hedge is None else str(hedge)
    try:
        for name, port in ports.items():
            stall = ["--stall-ms", str(args.stall_ms), "--stall-rate", str(args.stall_rate)] \
                if name == "staller" else []
            with open(logs / f"{name}-{tag}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [py, "-m", "gateway", "sim", "--port", str(port), "--max-batch", "16",
                     "--decode-base-ms", "10", "--decode-per-seq-ms", "0.5", "--seed",
                     str(args.seed), *stall], stdout=log, stderr=subprocess.STDOUT))
        with open(logs / f"gateway-{tag}.log", "wb") as log:
            gw = subprocess.Popen([py, "-m", "gateway", "serve", "--config", str(cfg),
                                   "--port", str(gw_port)], stdout=log, stderr=subprocess.STDOUT)
        procs.append(gw)
        for url, p in [*zip(urls.values(), procs, strict=False), (gw_url, gw)]:
            await demo.wait_ready(url + ("/readyz" if p is gw else "/health"), p.poll, 30)
        recs = await drive(gw_url, args.rate, args.seconds, args.seed)
        async with aiohttp.ClientSession() as s, s.get(gw_url + "/metrics") as r:
            metrics = await r.text()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        cfg.unlink(missing_ok=True)
    ttfts = [r["ttft"] for r in recs if r["ttft"] is not None]
    good = [r for r in recs if r["ok"] and r["ttft"] is not None and r["ttft"] <= TTFT_MS
            and (r["tpot"] is None or r["tpot"] <= TPOT_MS)]
    served = sum(r["tokens"] for r in recs)
    extra = sum(counters(metrics, "slogate_hedge_tokens_total", "kind").values())
    return {"mode": "no race" if hedge is None else f"hedge_after_ms = {hedge}",
            "requests": len(recs), "ok": sum(r["ok"] for r in recs),
            "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p99_ms": pct(ttfts, 0.99),
            "goodput": len(good) / len(recs) if recs else 0.0,
            "hedges": counters(metrics, "slogate_hedges_total", "result"),
            "skipped": counters(metrics, "slogate_hedges_skipped_total", "reason"),
            "extra_tokens": extra, "served_tokens": served,
            "extra_tokens_pct": 100.0 * extra / served if served else 0.0}


def render(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"One replica of two stalls {args.stall_rate:.0%} of its first tokens by "
             f"{args.stall_ms:.0f} ms; {args.rate:g} requests/s for {args.seconds:g} s per mode "
             f"(TTFT target {TTFT_MS:.0f} ms, TPOT {TPOT_MS:.0f} ms).", "",
             "| mode | TTFT p50 | TTFT p99 | goodput | races (won/lost/failed) | skipped "
             "| extra tokens |", "|---|---|---|---|---|---|---|"]
    for r in results:
        h = r["hedges"]
        races = "/".join(str(int(h.get(k, 0))) for k in ("won", "lost", "failed"))
        skipped = ", ".join(f"{k} {int(v)}" for k, v in sorted(r["skipped"].items())) or "—"
        lines.append(f"| {r['mode']} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
                     f"{r['goodput']:.1%} | {races} | {skipped} | "
                     f"{r['extra_tokens_pct']:.2f} % |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.scatter(r["extra_tokens_pct"], r["ttft_p99_ms"])
        ax.annotate(r["mode"].replace("hedge_after_ms = ", ""),
                    (r["extra_tokens_pct"], r["ttft_p99_ms"]))
    ax.set_xlabel("extra tokens (% of tokens served)")
    ax.set_ylabel("P99 TTFT (ms)")
    ax.set_title("First-token race: P99 TTFT against its cost")
    fig.tight_layout()
    fig.savefig(path)
    return True


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    logs = out / "faults-logs"
    logs.mkdir(parents=True, exist_ok=True)
    modes: list[float | str | None] = [None, *args.after, "auto"]
    results = []
    for hedge in modes:
        results.append(await run_mode(hedge, args, logs))
        print(render(results[-1:], args).splitlines()[-1], flush=True)
    (out / "faults.json").write_text(json.dumps(results, indent=2))
    table = render(results, args)
    (out / "faults.md").write_text(table)
    print("\n" + table)
    if plot(results, out / "faults.png"):
        print(f"figure: {out / 'faults.png'}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second")
    ap.add_argument("--stall-ms", type=float, default=2000.0)
    ap.add_argument("--stall-rate", type=float, default=0.05)
    ap.add_argument("--after", type=float, nargs="*", default=[150.0, 300.0, 600.0],
                    help="hedge_after_ms values to try (besides no race and auto)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench-results")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
