"""Measure the simulator's own streaming speed: tokens/s, per-token gap percentiles, CPU/token.

    python -m backends.sim.bench                     # spawns `slogate sim` with fast knobs
    python -m backends.sim.bench --url http://h:p    # measure a running simulator/gateway

Each of N concurrent clients streams `--tokens`-token chat answers back to back for
`--seconds`; gaps are measured between consecutive content chunks of one stream as seen by
an aiohttp client.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp

FAST = ["--decode-base-ms", "2", "--decode-per-seq-ms", "0", "--prefill-tokens-per-s", "1e9",
        "--max-batch", "1024"]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


class _Window:
    """What is measured: token arrivals between t_from and t_to (after the staggered ramp-up)."""

    def __init__(self, t_from: float, t_to: float) -> None:
        self.t_from, self.t_to = t_from, t_to
        self.tokens = 0
        self.gaps: list[float] = []
        self.ttfts: list[float] = []


async def _client(session: aiohttp.ClientSession, url: str, tokens: int, delay: float,
                  w: _Window) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "benchmark " * 8}],
            "stream": True, "max_tokens": tokens}
    await asyncio.sleep(delay)
    while time.perf_counter() < w.t_to:
        t0 = time.perf_counter()
        last = None
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            async for line in resp.content:
                if (line.startswith(b'data: {') and b'"content":"' in line
                        and b'"content":""' not in line):
                    now = time.perf_counter()
                    if w.t_from <= now <= w.t_to:
                        w.tokens += 1
                        if last is None:
                            if t0 >= w.t_from:
                                w.ttfts.append(now - t0)
                        elif last >= w.t_from:
                            w.gaps.append(now - last)
                    last = now


async def _steps(session: aiohttp.ClientSession, url: str) -> float:
    try:
        async with session.get(url + "/sim/stats") as r:
            return float((await r.json())["steps"])
    except (aiohttp.ClientError, KeyError, ValueError):
        return float("nan")


async def _level(url: str, streams: int, tokens: int, seconds: float, pid: int | None,
                 step_ms: float) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await _client(session, url, 5, 0, _Window(0, time.perf_counter() + 0.001))  # warm-up
        # stagger the starts over one answer's duration so the streams do not run in lockstep
        ramp = tokens * step_ms / 1000 * 1.5
        now = time.perf_counter()
        w = _Window(now + ramp, now + ramp + seconds)
        clients = [asyncio.ensure_future(_client(session, url, tokens, ramp * i / streams, w))
                   for i in range(streams)]
        await asyncio.sleep(w.t_from - time.perf_counter())
        steps0 = await _steps(session, url)
        cpu0 = _cpu_s(pid) if pid else 0.0
        me0 = _cpu_s(os.getpid())
        await asyncio.sleep(w.t_to - time.perf_counter())
        cpu = (_cpu_s(pid) - cpu0) if pid else float("nan")
        me = _cpu_s(os.getpid()) - me0
        steps = await _steps(session, url) - steps0
        await asyncio.gather(*clients)
    wall = w.t_to - w.t_from
    gaps, total = w.gaps, w.tokens
    return {
        "streams": streams, "tokens": total, "tok_s": total / wall,
        "gap_p50_ms": _pct(gaps, 50) * 1e3, "gap_p90_ms": _pct(gaps, 90) * 1e3,
        "gap_p99_ms": _pct(gaps, 99) * 1e3, "gap_max_ms": max(gaps) * 1e3 if gaps else float("nan"),
        "gap_mean_ms": statistics.fmean(gaps) * 1e3 if gaps else float("nan"),
        "ttft_p50_ms": _pct(w.ttfts, 50) * 1e3,
        "sim_cpu_us_per_token": cpu / total * 1e6 if total else float("nan"),
        "sim_cpu_share": cpu / wall,
        "client_cpu_share": me / wall,
        "sim_steps_s": steps / wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="measure this server instead of spawning a simulator")
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--port", type=int, default=18473)
    ap.add_argument("--step-ms", type=float, default=2.0,
                    help="the server's step time (for the ramp-up)")
    ap.add_argument("--taskset", default="",
                    help="CPU list to pin the spawned simulator to, e.g. 0")
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    pid = None
    if url is None:
        cmd = [sys.executable, "-m", "gateway.ops.cli", "sim", "--port", str(args.port), *FAST]
        if args.taskset:
            cmd = ["taskset", "-c", args.taskset, *cmd]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        pid = proc.pid
        url = f"http://127.0.0.1:{args.port}"
        for _ in range(100):
            try:
                import urllib.request
                urllib.request.urlopen(url + "/health", timeout=0.2)
                break
            except OSError:
                time.sleep(0.05)
    try:
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
        print(f"{'streams':>7} {'tok/s':>9} {'gap p50':>8} {'p90':>6} {'p99':>6} {'max':>6} "
              f"{'mean':>6} {'ttft p50':>8} {'sim µs/tok':>10} {'sim cpu':>7} "
              f"{'client cpu':>10} {'steps/s':>7}")
        for n in [int(x) for x in args.streams.split(",")]:
            r = asyncio.run(_level(url, n, args.tokens, args.seconds, pid, args.step_ms))
            print(f"{r['streams']:>7} {r['tok_s']:>9.0f} {r['gap_p50_ms']:>8.2f} "
                  f"{r['gap_p90_ms']:>6.2f} {r['gap_p99_ms']:>6.2f} {r['gap_max_ms']:>6.2f} "
                  f"{r['gap_mean_ms']:>6.2f} {r['ttft_p50_ms']:>8.2f} "
                  f"{r['sim_cpu_us_per_token']:>10.1f} {r['sim_cpu_share']:>7.0%} "
                  f"{r['client_cpu_share']:>10.0%} {r['sim_steps_s']:>7.0f}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
