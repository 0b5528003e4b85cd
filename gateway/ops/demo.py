"""`slogate demo`: the simulator and the gateway as a user would run them, a short load through
the official openai SDK, and what the client saw next to what the gateway recorded."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

EXAMPLE_CONFIG = Path(__file__).parent.parent / "examples" / "sim.toml"
PROMPT_WORDS = ("latency goodput prefill decode token stream gateway engine batch queue "
                "cache prefix replica deadline budget").split()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pick_port(preferred: int) -> int:
    return preferred if _port_free(preferred) else free_port()


async def wait_ready(url: str, exited: Callable[[], int | None], timeout: float = 30.0) -> None:
    """Poll `url` until it answers 200; `exited()` returns the process's exit status or None."""
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if exited() is not None:
                raise RuntimeError(f"process behind {url} exited with status {exited()}")
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


class GatewayLog:
    """Collects the gateway's JSON access-log lines (stderr) by request id."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}

    async def follow(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            if text.startswith("{"):
                try:
                    rec = orjson.loads(text)
                except orjson.JSONDecodeError:
                    rec = None
                if isinstance(rec, dict) and "request_id" in rec:
                    self.records[rec["request_id"]] = rec
                    continue
            print(f"  gateway | {text}", file=sys.stderr)


async def _one_request(client: Any, rng: random.Random) -> dict[str, Any] | None:
    prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.choice([20, 80, 400, 1500])))
    t0 = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-llama-8b", stream=True, max_tokens=rng.choice([32, 64, 128]),
        messages=[{"role": "user", "content": prompt}])
    request_id = raw.headers.get("x-slogate-request-id")
    stream = raw.parse()
    first: float | None = None
    last = 0.0
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            tokens += 1
    end = time.perf_counter()
    if first is None:
        return None
    rec: dict[str, Any] = {"request_id": request_id, "ttft": (first - t0) * 1e3,
                           "e2e": (end - t0) * 1e3}
    if tokens > 1:
        rec["tpot"] = (last - first) * 1e3 / (tokens - 1)
    return rec


async def drive_load(base_url: str, seconds: float, concurrency: int,
                     progress: bool = False) -> list[dict[str, Any]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="demo-key", max_retries=0)
    results: list[dict[str, Any]] = []
    start = time.monotonic()
    stop = start + seconds

    async def worker(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < stop:
            rec = await _one_request(client, rng)
            if rec:
                results.append(rec)

    shown: list[str] = []  # the progress lines printed so far
    reporter = asyncio.create_task(_progress(results, start, seconds, shown)) \
        if progress else None
    try:
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    finally:
        if reporter is not None:
            reporter.cancel()
        await client.close()
    if progress:
        _progress_line(results, start, seconds, shown, final=True)
    return results


def _progress_line(results: list[dict[str, Any]], start: float, seconds: float,
                   shown: list[str], final: bool = False) -> None:
    """One status line: rewritten in place on a terminal, a new line every few seconds
    otherwise (logs, CI), never the same line twice."""
    elapsed = min(seconds, time.monotonic() - start)
    ttfts = [r["ttft"] for r in results[-200:]]
    ttft = f" · TTFT p50 {_pct(ttfts, .5):.0f} ms p99 {_pct(ttfts, .99):.0f} ms" if ttfts else ""
    line = (f"  load {elapsed:4.0f}/{seconds:.0f} s · {len(results)} requests · "
            f"{len(results) / max(elapsed, 1e-3):.1f} req/s{ttft}")
    if sys.stdout.isatty():
        print("\r" + line.ljust(79), end="\n" if final else "", flush=True)
    elif not shown or shown[-1] != line:
        print(line, flush=True)
    shown.append(line)


async def _progress(results: list[dict[str, Any]], start: float, seconds: float,
                    shown: list[str]) -> None:
    interval = 0.5 if sys.stdout.isatty() else 2.0
    while True:
        await asyncio.sleep(interval)
        _progress_line(results, start, seconds, shown)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def render_table(client: list[dict[str, Any]], gateway: dict[str, dict[str, Any]]) -> str:
    rows = ["| metric (ms) | seen by | p50 | p90 | p99 | n |", "|---|---|---:|---:|---:|---:|"]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")):
        c = [r[key] for r in client if key in r]
        g = [gateway[r["request_id"]]["ms"][key] for r in client
             if r["request_id"] in gateway and key in gateway[r["request_id"]]["ms"]]
        for who, vals in (("client", c), ("gateway", g)):
            if vals:
                rows.append(f"| {label} | {who} | {_pct(vals, .5):.1f} | {_pct(vals, .9):.1f} | "
                            f"{_pct(vals, .99):.1f} | {len(vals)} |")
    return "\n".join(rows)


async def main(duration: float | None, port: int, sim_port: int, concurrency: int) -> int:
    started = time.monotonic()
    wanted = (("gateway", port), ("simulator", sim_port))
    port, sim_port = _pick_port(port), _pick_port(sim_port)
    print(f"slogate demo: live console at http://127.0.0.1:{port}/console "
          "(open it in a browser now)", flush=True)
    for (what, want), got in zip(wanted, (port, sim_port), strict=True):
        if got != want:  # the README's URL would reach whatever holds that port
            print(f"slogate demo: port {want} is taken; the {what} listens on {got} instead",
                  flush=True)
    # The summary table reads the gateway's JSON access log (sim.toml's own is short text).
    env = dict(os.environ, SLOGATE_SERVER_PORT=str(port),
               SLOGATE_SERVER_ACCESS_LOG_FORMAT="json",
               SLOGATE_BACKEND_SIM_BASE_URL=f"http://127.0.0.1:{sim_port}/v1")
    py = sys.executable
    sim = subprocess.Popen([py, "-m", "gateway", "sim", "--port", str(sim_port),
                            "--served-model-name", "sim-llama-8b"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gw = await asyncio.create_subprocess_exec(
        py, "-m", "gateway", "serve", "--config", str(EXAMPLE_CONFIG), env=env,
        stderr=asyncio.subprocess.PIPE)
    log = GatewayLog()
    follower = asyncio.create_task(log.follow(gw.stderr))  # type: ignore[arg-type]
    try:
        await wait_ready(f"http://127.0.0.1:{sim_port}/health", sim.poll)
        await wait_ready(f"http://127.0.0.1:{port}/readyz", lambda: gw.returncode)
        base = f"http://127.0.0.1:{port}/v1"
        # With a duration, load for all of it but the second the summary takes.
        load_s = 10.0 if duration is None else \
            max(2.0, duration - (time.monotonic() - started) - 1.0)
        print(f"slogate demo: simulator on :{sim_port}, gateway on :{port}; "
              f"{concurrency} openai-SDK clients streaming for {load_s:.0f} s ...", flush=True)
        results = await drive_load(base, load_s, concurrency, progress=True)
        await asyncio.sleep(0.3)  # let the last log lines arrive
        print(f"\n{len(results)} streamed requests through the gateway:\n")
        print(render_table(results, log.records))
        print(f"\nPoint your app at it:  OpenAI(base_url=\"{base}\", api_key=\"any\")")
        print(f"Live console:          http://127.0.0.1:{port}/console")
        if duration is None:
            print("Serving until Ctrl-C.", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        else:
            rest = duration - (time.monotonic() - started)
            if rest > 0:
                print(f"Serving for {rest:.0f} more s.", flush=True)
                await asyncio.sleep(rest)
        return 0
    finally:
        if gw.returncode is None:
            gw.terminate()
        sim.terminate()
        try:
            await asyncio.wait_for(gw.wait(), 10)
        except TimeoutError:
            gw.kill()
        sim.wait(10)
        follower.cancel()


def run(duration: float | None, port: int = 8080, sim_port: int = 8000,
        concurrency: int = 8) -> int:
    return asyncio.run(main(duration, port, sim_port, concurrency))
