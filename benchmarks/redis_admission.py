#!/usr/bin/env python3
"""Admission throughput with its shared state in Redis, Redis a round trip of 0, 1, 10 and 40 ms
away (a real redis-server behind tests/support/delay_proxy.py, which delays every byte by half
the round trip each way).

Starts redis-server, `slogate sim` (1 ms decode steps, a batch of 256) and, per round trip,
the proxy and `slogate serve` with admission on and `redis_url` through the proxy; then a
closed loop of `--concurrency` clients sends short non-streamed chat completions for
`--seconds`. Reported per round trip: requests/s, median and p99 latency, and where admission
kept its counts at the end (/admin/admission: redis or local).

    .venv/bin/python -m benchmarks.redis_admission --seconds 5
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson

CONFIG = """
[auth]
mode = "open"
slo_overrides = true
[server]
access_log = false
[admission]
enabled = true
redis_url = "redis://127.0.0.1:{redis_port}/0"
[[backends]]
name = "sim"
base_url = "http://127.0.0.1:{sim_port}/v1"
models = ["m"]
max_concurrency = 128
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"port {port}")
        time.sleep(0.02)


@contextlib.contextmanager
def process(*args: str) -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(list(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield p
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def load(url: str, seconds: float, concurrency: int) -> tuple[int, list[float]]:
    lat: list[float] = []
    end = time.monotonic() + seconds
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "60000"}  # queue, never refuse
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def client() -> None:
            while time.monotonic() < end:
                t0 = time.monotonic()
                async with s.post(url + "/v1/chat/completions", json=body,
                                  headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                lat.append(time.monotonic() - t0)

        await asyncio.gather(*[client() for _ in range(concurrency)])
    return len(lat), sorted(lat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rtt-ms", default="0,1,10,40")
    args = ap.parse_args()
    redis_bin = shutil.which("redis-server") or "/usr/bin/redis-server"
    redis_port, sim_port = free_port(), free_port()
    tmp = Path(tempfile.mkdtemp(prefix="slogate-bench-redis-"))
    py = sys.executable
    with process(redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(tmp)), \
            process(py, "-m", "gateway", "sim", "--port", str(sim_port), "--decode-base-ms",
                    "1", "--decode-per-seq-ms", "0", "--max-batch", "256"):
        wait_port(redis_port)
        wait_http(f"http://127.0.0.1:{sim_port}/health")
        for rtt in [float(x) for x in args.rtt_ms.split(",")]:
            port = redis_port
            with contextlib.ExitStack() as stack:
                if rtt > 0:
                    port = free_port()
                    stack.enter_context(process(py, "-m", "tests.support.delay_proxy",
                                                str(redis_port), str(rtt), str(port)))
                    wait_port(port)
                cfg = tmp / f"gw-{rtt}.toml"
                cfg.write_text(CONFIG.format(redis_port=port, sim_port=sim_port))
                gw_port = free_port()
                stack.enter_context(process(py, "-m", "gateway", "serve", "--config", str(cfg),
                                            "--port", str(gw_port)))
                url = f"http://127.0.0.1:{gw_port}"
                wait_http(url + "/readyz")
                asyncio.run(load(url, 1.0, args.concurrency))  # warm-up
                t0 = time.monotonic()
                n, lat = asyncio.run(load(url, args.seconds, args.concurrency))
                wall = time.monotonic() - t0
                with urllib.request.urlopen(url + "/admin/admission", timeout=5) as r:
                    mode = orjson.loads(r.read())["shared"]["state"]
                print(f"Redis RTT {rtt:>4g} ms: {n / wall:6.0f} req/s at c={args.concurrency}, "
                      f"p50 {1e3 * lat[len(lat) // 2]:6.1f} ms, p99 "
                      f"{1e3 * lat[int(len(lat) * 0.99)]:6.1f} ms, admission: {mode}",
                      flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
