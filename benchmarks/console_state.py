#!/usr/bin/env python3
"""What a loop of `GET /console/state` costs the gateway: requests/s and gateway CPU per poll.

Starts `slogate sim` and `slogate serve` (no pinning), sends `--fill` short streamed requests
so the console has classes, a waterfall and recent requests to show, then runs a closed loop of
`--concurrency` clients polling /console/state for `--seconds`. Reported: polls/s, the
gateway's CPU (utime + stime from /proc) per poll and as a share of one core.

    .venv/bin/python -m benchmarks.console_state --seconds 5
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
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

CONFIG = """
[auth]
mode = "open"
[server]
access_log = false
[[slo_classes]]
name = "interactive"
ttft_ms = 500
tpot_ms = 50
[[slo_classes]]
name = "batch"
ttft_ms = 20000
tpot_ms = 200
[[backends]]
name = "sim"
base_url = "{sim}/v1"
models = ["m"]
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


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def processes() -> Iterator[tuple[str, int]]:
    """The simulator and a gateway in front of it; yields (gateway URL, gateway pid)."""
    sim_port, gw_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    cfg = Path(tempfile.mkstemp(suffix=".toml")[1])
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "gateway", "sim", "--port",
                                       str(sim_port), "--decode-base-ms", "1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{sim_port}/health")
        cfg.write_text(CONFIG.format(sim=f"http://127.0.0.1:{sim_port}"))
        gw = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg),
                               "--port", str(gw_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gw)
        wait_http(f"http://127.0.0.1:{gw_port}/readyz")
        yield f"http://127.0.0.1:{gw_port}", gw.pid
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        cfg.unlink(missing_ok=True)


async def fill(url: str, n: int) -> None:
    async with aiohttp.ClientSession() as s:
        sem = asyncio.Semaphore(8)

        async def one(i: int) -> None:
            async with sem, s.post(url + "/v1/chat/completions", headers={
                    "x-slo-class": "batch" if i % 3 else "interactive"}, json={
                    "model": "m", "stream": True, "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"fill {i}"}]}) as r:
                await r.read()

        await asyncio.gather(*[one(i) for i in range(n)])


async def poll(url: str, seconds: float, concurrency: int) -> int:
    done = 0
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession() as s:
        async def client() -> None:
            nonlocal done
            while time.monotonic() < end:
                async with s.get(url + "/console/state") as r:
                    await r.read()
                    assert r.status == 200
                done += 1

        await asyncio.gather(*[client() for _ in range(concurrency)])
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--fill", type=int, default=300)
    args = ap.parse_args()
    with processes() as (url, pid):
        asyncio.run(fill(url, args.fill))
        c0, t0 = cpu_s(pid), time.monotonic()
        n = asyncio.run(poll(url, args.seconds, args.concurrency))
        cpu, wall = cpu_s(pid) - c0, time.monotonic() - t0
    print(f"/console/state: {n / wall:.0f} polls/s at c={args.concurrency}, gateway CPU "
          f"{1e6 * cpu / n:.0f} µs per poll, {100 * cpu / wall:.0f} % of a core")


if __name__ == "__main__":
    main()
