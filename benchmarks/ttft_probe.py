"""Added TTFT at rest: one streaming request at a time, alternating direct to the simulator and
through the gateway (and, with `--baseline REV`, through that revision's gateway), so every
path sees the same machine at the same moment. What `make bench` cannot show at 1 and 8
streams, where ~100 samples per repetition make a p99 of three values.

    python -m benchmarks.ttft_probe [--requests 150] [--baseline a0c69d9] [--rounds 3]

Prints per round the direct TTFT p50 and each gateway's added p50 and p90 (request sent →
first content event, measured by a raw aiohttp client; 20 warm-up requests per round)."""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks import overhead as ov

BODY = (b'{"model":"m","stream":true,"max_tokens":5,'
        b'"messages":[{"role":"user","content":"hi"}]}')


async def ttft(session: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=BODY,
                            headers={"Content-Type": "application/json"}) as r:
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            if b'"content":"' in buf.replace(b'"content":""', b""):
                t1 = time.perf_counter()
                async for _ in r.content.iter_any():
                    pass
                return t1 - t0
    raise RuntimeError(f"no content token from {url}")


async def probe(urls: dict[str, str], n: int, warmup: int = 20) -> dict[str, list[float]]:
    """Each path once per turn, the order rotated every turn: a fixed order biases the paths by
    position (measured: the one right after `direct` came out ~0.15 ms slower at rest)."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    paths = list(urls.items())
    async with aiohttp.ClientSession() as s:
        for i in range(n + warmup):
            k = i % len(paths)
            for name, url in paths[k:] + paths[:k]:
                t = await ttft(s, url)
                if i >= warmup:
                    out[name].append(t)
            await asyncio.sleep(0.01)
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", help="git revision to compare with")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="slogate-ttft-"))
    procs = ov.Procs(tmp)
    host, py = "127.0.0.1", sys.executable
    allowed = sorted(os.sched_getaffinity(0))
    sim_cpu, gw_cpu = ({allowed[0]}, {allowed[1]}) if len(allowed) > 1 else (None, None)
    sim_port = ov.free_port(host)
    try:
        procs.start("sim", shlex.split(ov.DEFAULT_SIM_CMD.format(
            python=py, host=host, port=sim_port, token_ms="2", max_batch="256")), sim_cpu)
        ov.wait_http(procs, "sim", f"http://{host}:{sim_port}/v1/models")
        urls = {"direct": f"http://{host}:{sim_port}/v1/chat/completions"}
        trees = {"gateway": ov.REPO}
        if args.baseline:
            base = tmp / "baseline"
            base.mkdir()
            archive = subprocess.run(["git", "archive", args.baseline], cwd=ov.REPO,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
            trees[args.baseline] = base
        for name, cwd in trees.items():
            port = ov.free_port(host)
            cfg = tmp / f"{name}.toml"
            cfg.write_text(ov.gateway_config(host, port, sim_port, 64, ""))
            env = dict(os.environ, PYTHONPATH=str(cwd))
            procs.start(name if name == "gateway" else "baseline", shlex.split(
                ov.DEFAULT_GATEWAY_CMD.format(python=py, config=cfg, host=host, port=port)),
                gw_cpu, env=env, cwd=cwd)
            ov.wait_http(procs, name, f"http://{host}:{port}/healthz")
            urls[name] = f"http://{host}:{port}/v1/chat/completions"
        for r in range(1, args.rounds + 1):
            res = asyncio.run(probe(urls, args.requests))
            direct = res.pop("direct")
            line = [f"round {r}: direct p50 {pct(direct, .5):.3f} ms"]
            for name, values in res.items():
                line.append(f"{name} +{pct(values, .5) - pct(direct, .5):.3f} p50 / "
                            f"+{pct(values, .9) - pct(direct, .9):.3f} p90 ms")
            print(";  ".join(line), flush=True)
    finally:
        procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
