#!/usr/bin/env python3
"""Hostile soak: the gateway (a real process, breaker off) in front of the simulator and a
hostile upstream, with 20 good streaming clients and hostile clients at once, for `--seconds`
(default 300); fails on a good stream that is not byte-exact, on memory that grows or stays up,
and on descriptors that do not come back.

    make soak-hostile                                  # 5 minutes
    python -m benchmarks.soak_hostile --seconds 60     # or any length

Three processes: `slogate sim` (decode 10 ms per token), the hostile upstream of
tests/support/hostile.py (`python -m tests.support.hostile`) and `slogate serve` in front of
both (max_event_bytes and max_response_bytes 1 MiB, max_body_bytes 1 MiB, header and body
deadlines 2 s, idle keep-alive 3 s, the hostile backend's first-token deadline 2 s, breaker
off). For the whole run, at once:

    good            20 clients, each a stream of 200 tokens after the other; every stream's
                    bytes must equal the simulator's own answer to the same request (fetched
                    once, directly) with its two per-request fields put in: the id (the
                    gateway's request id, from its header) and `created` (the simulator's
                    clock, from the stream's first event): byte-exact
    upstream        4 clients cycling through the hostile upstream's answers: gzip bomb,
                    endless JSON, endless SSE line, role chunks for ever, endless line after a
                    token, one 16 MiB event, trickled headers, reset before and after the first
                    token (each a limit hit, a deadline or an upstream error; 100 ms apart)
    slowloris       10 connections trickling their headers a byte per 200 ms (408; a reset
                    may overtake it)
    idle            50 connections that send nothing (closed at the header deadline)
    slow body       5 requests trickling their body, 5 announcing 1000 bytes and sending 10 (408)
    oversized body  2 clients: Content-Length 32 MiB, or a chunked body past 1 MiB (413)

Once a second: the gateway's RSS and descriptors (/proc), its in-flight gauge and open
connections (/metrics). After the run, once every client connection has closed: the checks —

    every good stream byte-exact, none failed (and every hostile one answered as expected:
    its status and error code, or its error event)
    RSS slope after the warm-up (least squares over the samples after the first minute, or the
    first third of a shorter run) at most 1 MiB/min, or 4 MiB over the fit window for a run
    shorter than 4 minutes after warm-up
    RSS at the end within 20 MiB of the RSS at the end of the warm-up
    descriptors back to the idle baseline (+2), nothing in flight, no client connection open

Prints a table and writes bench-results/soak-hostile.{json,csv}; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.procstat import open_fds, rss_mib
from benchmarks.soak import free_port, gauges, slope
from gateway.ops import demo
from tests.support import hostile
from tests.support.servers import stop_process

KEY = "soak-hostile-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 1 << 20  # max_event_bytes, max_response_bytes and max_body_bytes
TOKENS = 200
GOOD = {"model": "m", "stream": True, "max_tokens": TOKENS, "seed": 3,
        "messages": [{"role": "user", "content": "tell me something long"}]}
REF_ID = "00000000-0000-4000-8000-000000000000"
# hostile upstream answers, and what the client gets for each: (status, error code); for a
# committed stream (200) the code of its final error event
UPSTREAM: dict[str, tuple[bool, tuple[int, str]]] = {
    "bomb": (False, (502, "response_too_large")),
    "flood-json": (False, (502, "response_too_large")),
    "flood-line": (True, (502, "event_too_large")),
    "flood-prefirst": (True, (502, "event_too_large")),
    "flood-after": (True, (200, "event_too_large")),
    "huge-event": (True, (200, "event_too_large")),
    "slow-headers": (True, (504, "first_token_timeout")),
    "reset-before": (True, (502, "upstream_unreachable")),
    "reset-after": (True, (200, "stream_truncated")),
}


def config_toml(sim_url: str, evil_url: str) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    models = ", ".join(f'"{m}"' for m in UPSTREAM)
    return f"""
[auth]
mode = "keys"
[[auth.keys]]
tenant = "t"
sha256 = "{digest}"
[server]
access_log = false
header_timeout_s = 2
body_timeout_s = 2
idle_connection_timeout_s = 3
max_body_bytes = {LIMIT}
max_event_bytes = {LIMIT}
max_response_bytes = {LIMIT}
max_connections = 2000
max_connections_per_client = 0
[breaker]
failures = 1000000
[retry]
backoff_base_s = 0.001
[[backends]]
name = "sim"
base_url = "{sim_url}/v1"
models = ["m"]
[[backends]]
name = "evil"
base_url = "{evil_url}/v1"
models = [{models}]
timeouts = {{ first_token_s = 2.0, idle_s = 2.0 }}
"""


@dataclass
class Stack:
    """The three processes: the gateway's URL, port and pid, the simulator's URL, the log."""

    url: str
    port: int
    pid: int
    sim_url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.asynccontextmanager
async def stack(logs: Path) -> AsyncIterator[Stack]:
    """The simulator, the hostile upstream and the gateway in front of both, as processes on
    free ports (their output in `logs`/); stopped on the way out, also on failure."""
    logs.mkdir(parents=True, exist_ok=True)
    sim_port, evil_port, gw_port = free_port(), free_port(), free_port()
    sim_url, evil_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{evil_port}"
    url = f"http://127.0.0.1:{gw_port}"
    cfg = Path(tempfile.mkstemp(prefix="soak-hostile-", suffix=".toml")[1])
    cfg.write_text(config_toml(sim_url, evil_url))
    py = sys.executable
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, argv in (
                ("sim", ["-m", "gateway", "sim", "--port", str(sim_port), "--max-batch", "256",
                         "--decode-base-ms", "10", "--decode-per-seq-ms", "0", "--seed", "1"]),
                ("hostile", ["-m", "tests.support.hostile", "--port", str(evil_port)]),
                ("gateway", ["-m", "gateway", "serve", "--config", str(cfg), "--port",
                             str(gw_port)])):
            with open(logs / f"{name}.log", "wb") as out:
                procs.append(subprocess.Popen([py, *argv], stdout=out,
                                              stderr=subprocess.STDOUT))
        for p, ready in zip(procs, (sim_url + "/health", evil_url + "/health", url + "/readyz"),
                            strict=True):
            await demo.wait_ready(ready, p.poll, 60)
        yield Stack(url, gw_port, procs[2].pid, sim_url, logs / "gateway.log")
    finally:
        for p in reversed(procs):
            stop_process(p)
        cfg.unlink(missing_ok=True)


# -- clients -----------------------------------------------------------------------------------

async def reference(sim_url: str) -> bytes:
    """The simulator's own answer to GOOD, with id chatcmpl-REF_ID."""
    async with aiohttp.ClientSession() as s, s.post(
            sim_url + "/v1/chat/completions", json=GOOD, headers={"X-Request-Id": REF_ID}) as r:
        body = await r.read()
    assert r.status == 200 and body.endswith(b"data: [DONE]\n\n"), (r.status, body[-200:])
    return body


async def good_stream(s: aiohttp.ClientSession, url: str, ref: bytes) -> tuple[str, bytes]:
    """One good stream through the gateway: `exact`, `mismatch` (with the bytes) or why not."""
    try:
        async with s.post(url + "/v1/chat/completions", json=GOOD, headers=AUTH) as r:
            body = await r.read()
            rid = r.headers.get("x-slogate-request-id", "")
    except (aiohttp.ClientError, TimeoutError) as e:
        return f"client_{type(e).__name__}", b""
    if r.status != 200:
        return f"http_{r.status}", body
    return ("exact", b"") if body == expected(ref, body, rid) else ("mismatch", body)


def expected(ref: bytes, body: bytes, request_id: str) -> bytes:
    """The reference answer as the simulator would have written it for this request: its id
    and its `created` (seconds), every other byte the same."""
    created = re.search(rb'"created":(\d+)', body[:400])
    ref_created = re.search(rb'"created":(\d+)', ref[:400])
    out = ref.replace(f"chatcmpl-{REF_ID}".encode(), f"chatcmpl-{request_id}".encode())
    if created is None or ref_created is None:
        return out
    return out.replace(b'"created":' + ref_created.group(1), b'"created":' + created.group(1))


def error_code(body: bytes) -> str:
    codes = re.findall(rb'"code":\s*"([a-z_]+)"', body[-4096:])
    return codes[-1].decode() if codes else ""


async def upstream_request(s: aiohttp.ClientSession, url: str, model: str) -> str:
    """One request for a hostile upstream answer: `<status> <error code>`."""
    stream = UPSTREAM[model][0]
    try:
        async with s.post(url + "/v1/chat/completions", headers=AUTH, json={
                "model": model, "stream": stream,
                "messages": [{"role": "user", "content": "x"}]}) as r:
            body = await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        return f"client_{type(e).__name__}"
    code = error_code(body)
    if r.status == 200 and stream and not code:
        return "200 silent" if not body.endswith(b"data: [DONE]\n\n") else "200 done"
    return f"{r.status} {code}"


def raw_outcome(raw: bytes) -> str:
    if raw == hostile.RESET:
        return "reset"
    status = hostile.status_of(raw)
    return str(status) if status else "closed"


# -- the run -----------------------------------------------------------------------------------

@dataclass
class Run:
    seconds: float
    warm_s: float
    good: Counter[str]
    outcomes: dict[str, Counter[str]]
    samples: list[dict[str, float]]
    base: dict[str, float]
    end: dict[str, float]
    failures: list[str]
    slope: float
    window_min: float
    rss_warm: float

    def summary(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "warm_up_s": self.warm_s, "good": dict(self.good),
                "outcomes": {k: dict(v) for k, v in self.outcomes.items()},
                "baseline": self.base, "end": self.end, "rss_after_warm_up_mib": self.rss_warm,
                "rss_peak_mib": max((x["rss_mib"] for x in self.samples), default=0.0),
                "rss_slope_mib_per_min": round(self.slope, 3),
                "fit_window_min": round(self.window_min, 2),
                "fds_peak": max((x["fds"] for x in self.samples), default=0),
                "failures": self.failures}


async def settle(st: Stack, base_fds: int, timeout: float = 30.0) -> dict[str, float]:
    """Wait until nothing is in flight, no client connection but the probe's is open and the
    descriptors are back at `base_fds` (+2); returns the last reading."""
    end: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as probe:
        while True:
            end = {"rss_mib": rss_mib(st.pid), "fds": open_fds(st.pid),
                   **(await gauges(probe, st.url))}
            if (end["slogate_requests_in_flight"] == 0 and end["slogate_open_connections"] <= 1
                    and end["fds"] <= base_fds + 2) or time.monotonic() > deadline:
                return end
            await asyncio.sleep(0.5)


async def soak(seconds: float, out: Path, warm_s: float | None = None) -> Run:
    """The whole run (see the module docstring); `warm_s` defaults to min(60, seconds / 3)."""
    warm = min(60.0, seconds / 3) if warm_s is None else warm_s
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    t = time.monotonic()
    async with stack(out / "soak-hostile-logs") as st:
        print(f"  started in {time.monotonic() - t:.1f} s", flush=True)
        return await _soak(st, seconds, warm)


async def _soak(st: Stack, seconds: float, warm: float) -> Run:
    t_start = time.monotonic()
    ref = await reference(st.sim_url)
    assert ref.count(b"data: ") == TOKENS + 3  # role, the tokens, finish, [DONE]
    host, port = "127.0.0.1", st.port
    good: Counter[str] = Counter()
    outcomes: dict[str, Counter[str]] = {}
    mismatch: list[bytes] = []
    conn = aiohttp.TCPConnector(limit=0)
    s = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60))
    # Warm-up: good streams at full concurrency and each hostile answer once (but the one that
    # only waits for a deadline, twice); then the idle baseline once every client connection
    # has closed.
    warm_up = await asyncio.gather(*[good_stream(s, st.url, ref) for _ in range(20)],
                                   *[upstream_request(s, st.url, m) for m in UPSTREAM
                                     if m != "slow-headers"])
    assert all(r == "exact" for r, _ in warm_up[:20]), [r for r, _ in warm_up[:20]]
    await s.close()
    base_reading = await settle(st, 1 << 30, timeout=5)
    base = {"rss_mib": rss_mib(st.pid), "fds": open_fds(st.pid),
            "open_connections": base_reading["slogate_open_connections"]}
    print(f"  warm-up and baseline in {time.monotonic() - t_start:.1f} s: RSS "
          f"{base['rss_mib']:.1f} MiB, {base['fds']:.0f} fds", flush=True)
    s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                              timeout=aiohttp.ClientTimeout(total=60))
    running = True
    t0 = time.monotonic()

    def record(kind: str, outcome: str) -> None:
        outcomes.setdefault(kind, Counter())[outcome] += 1

    async def loop(step: Callable[[], Awaitable[None]], pause: float = 0.0) -> None:
        while running:
            await step()
            if pause:
                await asyncio.sleep(pause)

    async def one_good() -> None:
        result, body = await good_stream(s, st.url, ref)
        good[result] += 1
        if result == "mismatch" and len(mismatch) < 3:
            mismatch.append(body)

    models = list(UPSTREAM)

    def upstream_client(i: int) -> Callable[[], Awaitable[None]]:
        n = i

        async def step() -> None:
            nonlocal n
            model = models[n % len(models)]
            n += 1
            record(model, await upstream_request(s, st.url, model))
        return step

    def raw_client(kind: str, attack: Callable[[], Awaitable[bytes]]
                   ) -> Callable[[], Awaitable[None]]:
        async def step() -> None:
            try:
                record(kind, raw_outcome(await attack()))
            except (OSError, TimeoutError) as e:
                record(kind, f"client_{type(e).__name__}")
        return step

    clients = (
        [loop(one_good) for _ in range(20)]
        + [loop(upstream_client(i), 0.1) for i in range(4)]
        + [loop(raw_client("slowloris", lambda: hostile.slowloris(host, port, every_s=0.2)))
           for _ in range(10)]
        + [loop(raw_client("idle", lambda: hostile.idle_connection(host, port)))
           for _ in range(50)]
        + [loop(raw_client("slow body", lambda: hostile.slow_body(host, port, KEY)))
           for _ in range(5)]
        + [loop(raw_client("body never sent", lambda: hostile.body_never_arrives(
            host, port, KEY)), 0.5) for _ in range(5)]
        + [loop(raw_client("oversized body", lambda: hostile.oversized_body(
            host, port, KEY, 32 << 20)), 0.5),
           loop(raw_client("oversized chunked", lambda: hostile.oversized_body(
               host, port, KEY, 2 * LIMIT, chunked=True)), 0.5)])
    tasks = [asyncio.create_task(c) for c in clients]
    samples: list[dict[str, float]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as probe:
        next_report = 30.0
        while (t := time.monotonic() - t0) < seconds:
            g = await gauges(probe, st.url)
            samples.append({"t": round(t, 2), "rss_mib": round(rss_mib(st.pid), 2),
                            "fds": open_fds(st.pid), "in_flight": g["slogate_requests_in_flight"],
                            "open_connections": g["slogate_open_connections"],
                            "limit_hits": g["limit_hits"], "good_exact": good["exact"]})
            if t >= next_report:
                next_report += 30
                print(f"  t={t:4.0f}s rss={samples[-1]['rss_mib']:.1f}MiB "
                      f"fds={samples[-1]['fds']} good={good['exact']} "
                      f"limit hits={g['limit_hits']:.0f}", flush=True)
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - t)))
    running = False
    t_stop = time.monotonic()
    await asyncio.wait(tasks, timeout=30)
    for task in tasks:
        task.cancel()
    await s.close()
    end = await settle(st, int(base["fds"]))
    print(f"  clients stopped and the gateway settled in {time.monotonic() - t_stop:.1f} s",
          flush=True)
    return judge(st, seconds, warm, good, outcomes, samples, base, end, mismatch)


def judge(st: Stack, seconds: float, warm: float, good: Counter[str],
          outcomes: dict[str, Counter[str]], samples: list[dict[str, float]],
          base: dict[str, float], end: dict[str, float], mismatch: list[bytes]) -> Run:
    failures = []
    if not good["exact"] or set(good) != {"exact"}:
        failures.append(f"good streams: {dict(good)}")
    for n, body in enumerate(mismatch):
        path = st.log.with_name(f"mismatch-{n}.bin")
        path.write_bytes(body)
        failures.append(f"a good stream not byte-exact: {path}")
    expected_raw = {"slowloris": {"408", "reset"}, "idle": {"closed"},
                    "slow body": {"408", "reset"}, "body never sent": {"408"},
                    "oversized body": {"413"}, "oversized chunked": {"413", "reset"}}
    for kind, got in sorted(outcomes.items()):
        want = ({f"{UPSTREAM[kind][1][0]} {UPSTREAM[kind][1][1]}"} if kind in UPSTREAM
                else expected_raw[kind])
        wrong = {k: v for k, v in got.items() if k not in want}
        if wrong:
            failures.append(f"{kind}: {wrong} (expected {sorted(want)})")
    after = [x for x in samples if x["t"] >= warm]
    rss_slope = slope([x["t"] / 60 for x in after], [x["rss_mib"] for x in after])
    window_min = (after[-1]["t"] - after[0]["t"]) / 60 if len(after) > 1 else 0.0
    rss_warm = after[0]["rss_mib"] if after else base["rss_mib"]
    if window_min >= 4 and rss_slope > 1.0:
        failures.append(f"RSS grows {rss_slope:.2f} MiB/min after warm-up")
    if window_min < 4 and rss_slope * window_min > 4.0:
        failures.append(f"RSS grows {rss_slope * window_min:.1f} MiB over the {window_min:.1f} min "
                        f"after warm-up ({rss_slope:.2f} MiB/min)")
    if abs(end["rss_mib"] - rss_warm) > 20:
        failures.append(f"RSS {end['rss_mib']:.1f} MiB at the end, {rss_warm:.1f} MiB after "
                        "warm-up")
    if end["fds"] > base["fds"] + 2:
        failures.append(f"fds {end['fds']:.0f} at the end, baseline {base['fds']:.0f}")
    if end["slogate_requests_in_flight"] != 0:
        failures.append(f"in flight {end['slogate_requests_in_flight']:.0f} at the end")
    if end["slogate_open_connections"] > 1:
        failures.append(f"{end['slogate_open_connections']:.0f} connections open at the end")
    log = st.log_text()
    if "Traceback" in log:
        failures.append(f"a traceback in the gateway's log ({st.log})")
    return Run(seconds, warm, good, outcomes, samples, base, end, failures, rss_slope, window_min,
               rss_warm)


def table(run: Run) -> str:
    lines = ["| clients | outcome (count) |", "|---|---|",
             f"| good streams (20) | {_counts(run.good)} |"]
    for kind, got in run.outcomes.items():
        lines.append(f"| {kind} | {_counts(got)} |")
    peak = max((x["rss_mib"] for x in run.samples), default=0.0)
    fds_peak = max((x["fds"] for x in run.samples), default=0)
    hits = run.samples[-1]["limit_hits"] if run.samples else 0
    lines += ["", "| measure | value |", "|---|---|",
              f"| seconds (warm-up) | {run.seconds:.0f} ({run.warm_s:.0f}) |",
              f"| upstream limit hits | {hits:.0f} |",
              f"| RSS idle / after warm-up / peak / end (MiB) | {run.base['rss_mib']:.1f} / "
              f"{run.rss_warm:.1f} / {peak:.1f} / {run.end['rss_mib']:.1f} |",
              f"| RSS slope after warm-up (MiB/min, over {run.window_min:.1f} min) | "
              f"{run.slope:+.2f} |",
              f"| fds idle / peak / end | {run.base['fds']:.0f} / {fds_peak:.0f} / "
              f"{run.end['fds']:.0f} |"]
    return "\n".join(lines)


def _counts(c: Counter[str]) -> str:
    return ", ".join(f"{k} ({v})" for k, v in c.most_common())


def write(run: Run, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak-hostile.json").write_text(json.dumps(run.summary(), indent=2))
    with open(out / "soak-hostile.csv", "w") as f:
        cols = list(run.samples[0]) if run.samples else []
        f.write(",".join(cols) + "\n")
        for x in run.samples:
            f.write(",".join(str(x[c]) for c in cols) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="length of the run")
    parser.add_argument("--warm-up", type=float, default=None,
                        help="seconds before the RSS fit (default: min(60, seconds / 3))")
    parser.add_argument("--out", default="bench-results", help="output folder")
    args = parser.parse_args()
    out = Path(args.out)
    print(f"soak-hostile: {args.seconds:.0f} s", flush=True)
    run = asyncio.run(soak(args.seconds, out, args.warm_up))
    write(run, out)
    print(table(run))
    if run.failures:
        print("SOAK-HOSTILE FAILED: " + "; ".join(run.failures))
        return 1
    print("soak-hostile ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
