#!/usr/bin/env python3
"""Soak: the gateway in front of the simulator at about 70 % of its capacity for SOAK_S seconds
(default 600), with faults injected, and a check that nothing leaks.

The simulator (max batch 16, decode step 20 ms + 0.5 ms per sequence, 32 output tokens per
request) serves B / (T * step) = 16 / (32 * 28 ms) = 17.9 requests/s; the load is an open-loop
Poisson schedule at `--load` (0.7) times that. Each arrival is one of (seeded):

    ok 60 %        a normal stream
    cut 5 %        the engine drops the connection after 10 tokens (x-sim-cut-after)
    error 5 %      the engine sends an error event after 10 tokens (x-sim-error-after)
    stall 5 %      the first token comes 300 ms late (x-sim-stall-ms)
    http_503 5 %   the engine answers 503 (x-sim-status; retried, then passed through)
    slow_client 5 %  a client that reads one chunk per 50 ms
    vanish 5 %     a client that leaves after the first chunk
    slowloris 5 %  a connection that trickles headers until the gateway closes it (408)
    idle 5 %       a connection that sends nothing until the gateway closes it

Every request is accounted for at the client: completed ([DONE]), error event (a stream that
ends with an error object), HTTP error (status), gone (the client left on purpose), closed
(slowloris/idle: 408 or a close). A 200 stream that ends with neither [DONE] nor an error
event is `silent` and fails the soak.

Once a second: the gateway's RSS and open descriptors (/proc), its in-flight gauge and open
connections (/metrics). It fails if, after the warm-up (the first 20 %), RSS grows by more than
4 MiB over the rest of the run (least-squares slope × time; 0.5 MiB/min for a 10-minute run), or
if at the end descriptors, in-flight and open connections are not back to their idle baseline.

    SOAK_S=600 make soak        # or: python -m benchmarks.soak --duration 60
Writes bench-results/soak.json, soak.csv and soak.png (RSS, fds, in-flight over time).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from benchmarks.procstat import open_fds, rss_mib
from gateway.ops import demo

MAX_BATCH, BASE_MS, PER_SEQ_MS, TOKENS = 16, 20.0, 0.5, 32
CAPACITY_RPS = MAX_BATCH / (TOKENS * (BASE_MS + PER_SEQ_MS * MAX_BATCH) / 1e3)
KINDS = [("ok", 60), ("cut", 5), ("error", 5), ("stall", 5), ("http_503", 5),
         ("slow_client", 5), ("vanish", 5), ("slowloris", 5), ("idle", 5)]
FAULT_HEADERS = {"cut": {"x-sim-cut-after": "10"}, "error": {"x-sim-error-after": "10"},
                 "stall": {"x-sim-stall-ms": "300"}, "http_503": {"x-sim-status": "503"}}
BODY = {"model": "m", "stream": True, "max_tokens": TOKENS,
        "messages": [{"role": "user", "content": "soak"}]}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # (host, port) for AF_INET
        return port


async def gauges(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for name in ("slogate_requests_in_flight", "slogate_open_connections"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else -1.0
    out["requests_total"] = sum(float(v) for v in re.findall(
        r"^slogate_requests_total\{[^}]*\} (\S+)$", text, re.M))
    out["limit_hits"] = sum(float(v) for v in re.findall(
        r"^slogate_limits_exceeded_total\{[^}]*\} (\S+)$", text, re.M))
    return out


# -- one arrival -------------------------------------------------------------------------------

async def stream(s: aiohttp.ClientSession, url: str, kind: str) -> str:
    headers = {"x-sim-output-tokens": str(TOKENS), **FAULT_HEADERS.get(kind, {})}
    try:
        async with s.post(url + "/v1/chat/completions", json=BODY, headers=headers) as r:
            if r.status != 200:
                await r.read()
                return f"http_{r.status}"
            tail = b""
            async for chunk in r.content.iter_any():
                if kind == "vanish":
                    r.close()
                    return "gone"
                if kind == "slow_client":
                    await asyncio.sleep(0.05)
                tail = (tail + chunk)[-2048:]
            # An in-band error (the gateway's own, or the engine's passed through, which vLLM
            # may follow with [DONE]) is near the end of the stream.
            if b'{"error"' in tail:
                return "error_event"
            if tail.endswith(b"data: [DONE]\n\n"):
                return "completed"
            return "silent"
    except (TimeoutError, aiohttp.ClientError) as e:
        return f"client_error_{type(e).__name__}"


async def raw(host: str, port: int, kind: str) -> str:
    try:
        r, w = await asyncio.open_connection(host, port)
    except OSError:
        return "connect_failed"
    try:
        if kind == "slowloris":
            reader = asyncio.ensure_future(r.read())
            for b in b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096:
                if reader.done():
                    break
                w.write(bytes([b]))
                await asyncio.wait([reader], timeout=0.5)
            data = await reader
        else:
            data = await r.read()
        status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "close"
        return f"closed_{status}"
    except (ConnectionError, OSError):
        return "closed_reset"
    finally:
        w.close()


# -- the run -----------------------------------------------------------------------------------

async def run(duration: float, load: float, seed: int, out: Path) -> int:
    sim_port, gw_port = free_port(), free_port()
    sim_url, gw_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{gw_port}"
    cfg = Path(tempfile.mkstemp(suffix=".toml")[1])
    cfg.write_text(f"""
[auth]
mode = "open"
[server]
access_log = false
header_timeout_s = 2
body_timeout_s = 10
[retry]
max_attempts = 2
[breaker]
failures = 1000000
[[backends]]
name = "sim"
base_url = "{sim_url}/v1"
models = ["m"]
forward_headers = ["x-sim-*"]  # the faults are injected per request
""")
    logs = out / "soak-logs"
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    with open(logs / "sim.log", "wb") as sim_log, open(logs / "gateway.log", "wb") as gw_log:
        sim = subprocess.Popen([py, "-m", "gateway", "sim", "--port", str(sim_port),
                                "--max-batch", str(MAX_BATCH), "--decode-base-ms", str(BASE_MS),
                                "--decode-per-seq-ms", str(PER_SEQ_MS), "--seed", str(seed)],
                               stdout=sim_log, stderr=subprocess.STDOUT)
        gw = subprocess.Popen([py, "-m", "gateway", "serve", "--config", str(cfg), "--port",
                               str(gw_port)], stdout=gw_log, stderr=subprocess.STDOUT)
    try:
        await demo.wait_ready(sim_url + "/health", sim.poll, 30)
        await demo.wait_ready(gw_url + "/readyz", gw.poll, 30)
        return await _soak(gw.pid, gw_url, gw_port, duration, load, seed, out)
    finally:
        for p in (gw, sim):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        cfg.unlink(missing_ok=True)


async def _soak(pid: int, url: str, port: int, duration: float, load: float, seed: int,
                out: Path) -> int:
    rng = random.Random(seed)
    rate = CAPACITY_RPS * load
    names = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    conn = aiohttp.TCPConnector(limit=0)
    s = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120))
    probe = aiohttp.ClientSession()
    # Idle baseline after a short warm-up of plain streams.
    await asyncio.gather(*[stream(s, url, "ok") for _ in range(8)])
    await conn.close()
    conn = aiohttp.TCPConnector(limit=0)
    s = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120))
    await asyncio.sleep(1.0)
    base = {"rss": rss_mib(pid), "fds": open_fds(pid), **(await gauges(probe, url))}
    samples: list[dict[str, float]] = []
    results: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {k: Counter() for k in names}
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.monotonic()
    sent = 0

    async def one(kind: str) -> None:
        res = await (raw("127.0.0.1", port, kind) if kind in ("slowloris", "idle")
                     else stream(s, url, kind))
        results[res] += 1
        by_kind[kind][res] += 1

    async def sampler() -> None:
        while True:
            g = await gauges(probe, url)
            samples.append({"t": round(time.monotonic() - t0, 2), "rss_mib": rss_mib(pid),
                            "fds": open_fds(pid), "in_flight": g["slogate_requests_in_flight"],
                            "open_connections": g["slogate_open_connections"],
                            "client_tasks": len(tasks)})
            await asyncio.sleep(1.0)

    sampling = asyncio.create_task(sampler())
    next_at = t0
    last_report = t0
    while True:
        now = time.monotonic()
        if now - t0 >= duration:
            break
        if now < next_at:
            await asyncio.sleep(min(next_at - now, 0.5))
            continue
        next_at += rng.expovariate(rate)
        kind = rng.choices(names, weights)[0]
        task = asyncio.create_task(one(kind))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        sent += 1
        if now - last_report >= 30:
            last_report = now
            smp = samples[-1] if samples else {}
            print(f"  t={now - t0:5.0f}s sent={sent} rss={smp.get('rss_mib', 0):.1f}MiB "
                  f"fds={smp.get('fds', 0)} in_flight={smp.get('in_flight', 0):.0f}", flush=True)
    if tasks:
        await asyncio.wait(tasks, timeout=60)
    await s.close()
    sampling.cancel()
    await probe.close()
    # Settle: every connection closed (the gauge counts the probe's own, which closes after
    # each request), nothing in flight, descriptors back.
    end = {}
    probe = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        end = {"rss": rss_mib(pid), "fds": open_fds(pid), **(await gauges(probe, url))}
        if (end["slogate_requests_in_flight"] == 0 and end["slogate_open_connections"] <= 1
                and end["fds"] <= base["fds"] + 2):
            break
        await asyncio.sleep(0.5)
    await probe.close()

    warm = [x for x in samples if x["t"] >= 0.2 * duration]
    rss_slope = slope([x["t"] / 60 for x in warm], [x["rss_mib"] for x in warm])
    accounted = sum(results.values())
    failures = []
    if accounted != sent:
        failures.append(f"{sent - accounted} requests unaccounted for")
    if results.get("silent"):
        failures.append(f"{results['silent']} silent streams (200, no [DONE], no error event)")
    window_min = (warm[-1]["t"] - warm[0]["t"]) / 60 if len(warm) > 1 else 0.0
    if rss_slope * window_min > 4.0:
        failures.append(f"RSS grows {rss_slope:.2f} MiB/min after warm-up "
                        f"({rss_slope * window_min:.1f} MiB over {window_min:.1f} min)")
    if end.get("slogate_requests_in_flight", 1) != 0:
        failures.append(f"in-flight {end.get('slogate_requests_in_flight')} at the end")
    if end.get("slogate_open_connections", 99) > 1:
        failures.append(f"{end.get('slogate_open_connections')} connections open at the end")
    if end.get("fds", 1 << 30) > base["fds"] + 2:
        failures.append(f"fds {end.get('fds')} at the end, baseline {base['fds']}")
    summary = {
        "duration_s": duration, "load": load, "rate_rps": round(rate, 2),
        "capacity_rps": round(CAPACITY_RPS, 2), "sent": sent, "results": dict(results),
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "baseline": base, "end": end,
        "rss_peak_mib": max((x["rss_mib"] for x in samples), default=0),
        "rss_slope_mib_per_min": round(rss_slope, 3),
        "fds_peak": max((x["fds"] for x in samples), default=0),
        "in_flight_peak": max((x["in_flight"] for x in samples), default=0),
        "failures": failures,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    with open(out / "soak.csv", "w") as f:
        cols = list(samples[0]) if samples else []
        f.write(",".join(cols) + "\n")
        for x in samples:
            f.write(",".join(str(x[c]) for c in cols) + "\n")
    _plot(samples, out / "soak.png", duration)
    print(json.dumps(summary, indent=2))
    if failures:
        print("SOAK FAILED: " + "; ".join(failures))
        return 1
    print("soak ok")
    return 0


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than 3 points)."""
    n = len(xs)
    if n < 3:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _plot(samples: list[dict[str, float]], path: Path, duration: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    t = [x["t"] for x in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    for ax, key, label in zip(axes, ("rss_mib", "fds", "in_flight"),
                              ("gateway RSS (MiB)", "open fds", "in flight"), strict=True):
        ax.plot(t, [x[key] for x in samples])
        ax.set_ylabel(label)
        ax.axvline(0.2 * duration, color="grey", lw=0.5, ls="--")
        ax.grid(alpha=0.3)
    axes[2].plot(t, [x["open_connections"] for x in samples], label="open connections")
    axes[2].legend(loc="upper right")
    axes[-1].set_xlabel("seconds")
    fig.suptitle("slogate soak (dashed: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float,
                        default=float(os.environ.get("SOAK_S", "600")),
                        help="seconds of load (default: $SOAK_S or 600)")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of capacity")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench-results", help="output folder")
    args = parser.parse_args()
    print(f"soak: {args.duration:.0f} s at {args.load:.0%} of {CAPACITY_RPS:.1f} req/s")
    return asyncio.run(run(args.duration, args.load, args.seed, Path(args.out)))


if __name__ == "__main__":
    sys.exit(main())
