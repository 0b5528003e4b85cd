#!/usr/bin/env python3
"""Streaming-overhead benchmark: the gateway versus a direct connection to the simulator.

The benchmark starts the engine simulator and the gateway itself (free ports, a temporary config,
readiness checks, both killed at the end even on failure), then, for each concurrency level,
runs a closed-loop load of streaming chat completions first directly against the simulator and
then through the gateway. Each client worker sends one request after another; each request
streams `--tokens` content tokens at one per `--token-ms` (sim: decode-base-ms = token-ms,
decode-per-seq-ms = 0, a huge prefill rate and a batch large enough for every stream).

Measured at the client, for both paths:
  TTFT   time from sending the request to the first SSE event whose delta.content is non-empty
         (not the first byte: the role-only first chunk is not a token);
  ITL    gaps between successive content events of one stream;
  tok/s  content events received per second in the measurement window, all streams together.
And for the gateway: added TTFT / ITL (gateway percentile − direct percentile), tokens/s ratio,
CPU µs per streamed token (utime+stime of the gateway process from /proc/PID/stat over the
window, divided by the tokens streamed through it in the window) and RSS (VmRSS at the end).

The load generator is a separate process per point (raw aiohttp + uvloop, a minimal SSE event
splitter with a byte check for non-empty content), so the orchestrator never competes with it.
Placement: gateway alone on one core; simulator and load generator share the other. Both paths
see the same simulator + client load on their core, so the comparison is fair; the tables
also show each process's CPU use so that a saturated core is visible.

Usage (from the repository root):
    .venv/bin/python benchmarks/overhead.py                 # 1,8,64,256 streams, 10 s each
    .venv/bin/python benchmarks/overhead.py --quick         # 1,8 streams, 3 s each (smoke)
    .venv/bin/python benchmarks/overhead.py --profile bench-results/profile
    .venv/bin/python -m benchmarks.overhead --paced [--quick]  # only the paced-stream lane
                                                    # (benchmarks/paced.py; it also runs after
                                                    # the phases above unless --no-paced)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypedDict

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

DEFAULT_GATEWAY_CMD = "{python} -m gateway serve --config {config} --host {host} --port {port}"
DEFAULT_SIM_CMD = ("{python} -m gateway sim --host {host} --port {port} "
                   "--decode-base-ms {token_ms} --decode-per-seq-ms 0 "
                   "--prefill-tokens-per-s 1e9 --max-batch {max_batch}")
PCTS = (50, 90, 99, 99.9)


# ---------------------------------------------------------------------------------------------
# /proc readers
# ---------------------------------------------------------------------------------------------

def proc_cpu_s(pid: int) -> tuple[float, float] | None:
    """(utime, stime) of the whole process (all threads), in seconds; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after the last ')' are fixed.
    fields = raw[raw.rindex(b")") + 2:].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK  # fields 14, 15 of proc(5)


def proc_sched_ns(pid: int) -> tuple[int, int] | None:
    """(on-CPU ns, runnable-but-waiting ns) summed over the process's threads
    (/proc/PID/task/*/schedstat). The first is utime+stime without the 10 ms tick granularity;
    the second is time spent on a run queue waiting for a CPU: on a shared machine it is the
    direct measure of how much other work delayed this process."""
    run = wait = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                parts = f.read().split()
            run += int(parts[0])
            wait += int(parts[1])
    except (OSError, ValueError, IndexError):
        return None
    return run, wait


def proc_rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def percentiles(values: list[float],
                pcts: tuple[float, ...] = PCTS) -> dict[str, float | None]:
    """Linear-interpolated percentiles, plus mean, max and count. Values in seconds → ms."""
    n = len(values)
    out: dict[str, float | None] = {"n": n}
    if not n:
        for p in pcts:
            out[f"p{p:g}"] = None
        out["mean"] = out["max"] = None
        return out
    values.sort()
    for p in pcts:
        k = (n - 1) * p / 100.0
        lo = int(k)
        hi = min(lo + 1, n - 1)
        out[f"p{p:g}"] = (values[lo] + (values[hi] - values[lo]) * (k - lo)) * 1e3
    out["mean"] = sum(values) / n * 1e3
    out["max"] = values[-1] * 1e3
    return out


# ---------------------------------------------------------------------------------------------
# Load generator (runs in its own process: `overhead.py --client-spec SPEC --client-out OUT`)
# ---------------------------------------------------------------------------------------------

_CONTENT = b'"content":"'
_ERROR = b'"error"'


async def _client_run(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp
    import orjson

    url: str = spec["url"]
    streams: int = spec["streams"]
    warmup: float = spec["warmup"]
    duration: float = spec["duration"]
    watch: dict[str, int] = spec.get("watch", {})
    body = orjson.dumps({
        "model": spec.get("model", "sim"),
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "stream": True,
        "max_tokens": spec["tokens"],
    })
    headers = {
        "Content-Type": "application/json",
        "Authorization": "Bearer bench",
        "x-sim-output-tokens": str(spec["tokens"]),
    }
    clock = time.perf_counter
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    session = aiohttp.ClientSession(
        connector=connector, auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )
    ttfts: list[float] = []
    hdrs: list[float] = []  # request sent → response headers
    fbs: list[float] = []  # request sent → first body byte
    gaps: list[float] = []
    st = {"tokens": 0, "requests": 0, "completed": 0, "errors": 0, "short": 0}
    errors: Counter[str] = Counter()
    stop = False
    t0 = clock()
    w0 = t0 + warmup
    w1 = w0 + duration
    # Stagger the workers over one request's nominal length, so that they do not all start
    # (and end) their requests on the same engine step.
    stagger = min(spec["tokens"] * spec["token_ms"] / 1000.0, warmup / 2)

    async def one_request() -> None:
        t_send = clock()
        in_win = w0 <= t_send < w1
        if in_win:
            st["requests"] += 1
        first = True
        last = 0.0
        n_tok = 0
        tokens_in_window = 0
        async with session.post(url, data=body, headers=headers) as resp:
            if in_win:
                hdrs.append(clock() - t_send)
            if resp.status != 200:
                await resp.read()
                errors[f"http_{resp.status}"] += 1
                if in_win:
                    st["errors"] += 1
                await asyncio.sleep(0.05)
                return
            buf = b""
            fb_pending = in_win
            content = resp.content
            async for chunk in content.iter_any():
                t = clock()
                if fb_pending:
                    fbs.append(t - t_send)
                    fb_pending = False
                buf = buf + chunk if buf else chunk
                pos = 0
                find = buf.find
                while True:
                    end = find(b"\n\n", pos)
                    if end < 0:
                        break
                    j = find(_CONTENT, pos, end)
                    if j >= 0 and buf[j + 11] != 34:  # non-empty string value
                        n_tok += 1
                        if w0 <= t < w1:
                            tokens_in_window += 1
                            if first:
                                if in_win:
                                    ttfts.append(t - t_send)
                            else:
                                gaps.append(t - last)
                        first = False
                        last = t
                    elif find(_ERROR, pos, end) >= 0:
                        errors["stream_error_event"] += 1
                        if in_win:
                            st["errors"] += 1
                    pos = end + 2
                buf = buf[pos:] if pos < len(buf) else b""
        st["tokens"] += tokens_in_window
        if in_win:
            st["completed"] += 1
            if n_tok != spec["tokens"]:
                st["short"] += 1

    async def worker(i: int) -> None:
        await asyncio.sleep(stagger * i / streams)
        while not stop:
            try:
                await one_request()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # count and go on; the table shows it
                errors[type(e).__name__] += 1
                if w0 <= clock() < w1:
                    st["errors"] += 1
                await asyncio.sleep(0.05)

    def sample() -> dict[str, Any]:
        s: dict[str, Any] = {"t": clock()}
        for name, pid in {**watch, "client": os.getpid()}.items():
            s[name] = (proc_cpu_s(pid), proc_sched_ns(pid))
        return s

    tasks = [asyncio.create_task(worker(i)) for i in range(streams)]
    await asyncio.sleep(max(0.0, w0 - clock()))
    s0 = sample()
    await asyncio.sleep(max(0.0, w1 - clock()))
    s1 = sample()
    rss = {name: proc_rss_kib(pid) for name, pid in watch.items()}
    stop = True
    # In-flight requests finish (bounded), then anything left is cancelled.
    done, pending = await asyncio.wait(tasks, timeout=spec.get("grace", 10.0))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await session.close()

    window = s1["t"] - s0["t"]
    cpu: dict[str, Any] = {}
    for name in (*watch, "client"):
        (a_stat, a_ns), (b_stat, b_ns) = s0[name], s1[name]
        gone = a_stat is None or b_stat is None
        cpu[name] = {
            "cpu_s": None if gone else (b_stat[0] + b_stat[1]) - (a_stat[0] + a_stat[1]),
            "user_s": None if gone else b_stat[0] - a_stat[0],
            "sys_s": None if gone else b_stat[1] - a_stat[1],
            "cpu_s_schedstat": None if a_ns is None or b_ns is None else (b_ns[0] - a_ns[0]) / 1e9,
            "runq_wait_s": None if a_ns is None or b_ns is None else (b_ns[1] - a_ns[1]) / 1e9,
        }
    for c in cpu.values():
        c["util"] = None if c["cpu_s"] is None else c["cpu_s"] / window
        c["runq_wait_frac"] = None if c["runq_wait_s"] is None else c["runq_wait_s"] / window
    return {
        "window_s": window,
        "requests": st["requests"],
        "completed": st["completed"],
        "short_streams": st["short"],
        "errors": st["errors"],
        "error_kinds": dict(errors),
        "tokens": st["tokens"],
        "tokens_per_s": st["tokens"] / window,
        "ttft_ms": percentiles(ttfts),
        "headers_ms": percentiles(hdrs),
        "first_byte_ms": percentiles(fbs),
        "itl_ms": percentiles(gaps),
        "cpu": cpu,
        "rss_kib": rss,
    }


async def _slow_client_run(spec: dict[str, Any]) -> dict[str, Any]:
    """Many long-lived slow streams (agents, voice): open `streams` of them over `ramp`
    seconds, let them settle, then measure the watched processes over `duration` seconds
    while every stream stays open (each lasts longer than the whole run)."""
    import aiohttp
    import orjson

    n: int = spec["streams"]
    url: str = spec["url"]
    watch: dict[str, int] = spec.get("watch", {})
    body = orjson.dumps({"model": "sim", "messages": [{"role": "user", "content": "Hi."}],
                         "stream": True, "max_tokens": spec["tokens"]})
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench",
               "x-sim-output-tokens": str(spec["tokens"])}
    clock = time.perf_counter
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=None),
        skip_auto_headers=("User-Agent", "Accept-Encoding"))
    st = {"open": 0, "first": 0, "tokens": 0, "errors": 0, "ended": 0}
    errors: Counter[str] = Counter()
    gaps: list[float] = []
    window = [float("inf"), float("inf")]

    async def one(i: int) -> None:
        await asyncio.sleep(spec["ramp"] * i / n)
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                if resp.status != 200:
                    errors[f"http_{resp.status}"] += 1
                    st["errors"] += 1
                    return
                st["open"] += 1
                last = 0.0
                async for chunk in resp.content.iter_any():
                    t = clock()
                    k = chunk.count(_CONTENT)
                    if not k:
                        continue
                    if not last:
                        st["first"] += 1
                    elif window[0] <= t < window[1]:
                        gaps.append(t - last)
                    if window[0] <= t < window[1]:
                        st["tokens"] += k
                    last = t
                st["ended"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:
            errors[type(e).__name__] += 1
            st["errors"] += 1

    def sample() -> dict[str, Any]:
        out: dict[str, Any] = {"t": clock()}
        for name, pid in {**watch, "client": os.getpid()}.items():
            out[name] = (proc_cpu_s(pid), proc_sched_ns(pid))
        return out

    rss0 = {name: proc_rss_kib(pid) for name, pid in watch.items()}
    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    t_end_ramp = clock() + spec["ramp"] + 30
    while st["first"] + st["errors"] < n and clock() < t_end_ramp:
        await asyncio.sleep(0.2)
    await asyncio.sleep(spec["warmup"])
    s0 = sample()
    window[0], window[1] = s0["t"], s0["t"] + spec["duration"]
    await asyncio.sleep(spec["duration"])
    s1 = sample()
    rss = {name: proc_rss_kib(pid) for name, pid in watch.items()}
    streams_open = st["open"] - st["ended"]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.close()
    span = s1["t"] - s0["t"]
    cpu: dict[str, Any] = {}
    for name in (*watch, "client"):
        (a_stat, a_ns), (b_stat, b_ns) = s0[name], s1[name]
        c: dict[str, Any] = {"cpu_s": None, "runq_wait_frac": None, "util": None}
        if a_stat is not None and b_stat is not None:
            c["cpu_s"] = (b_stat[0] + b_stat[1]) - (a_stat[0] + a_stat[1])
            c["util"] = c["cpu_s"] / span
        if a_ns is not None and b_ns is not None:
            c["cpu_s_schedstat"] = (b_ns[0] - a_ns[0]) / 1e9
            c["runq_wait_frac"] = (b_ns[1] - a_ns[1]) / 1e9 / span
        cpu[name] = c
    return {"window_s": span, "streams": n, "streams_open": streams_open,
            "errors": st["errors"], "error_kinds": dict(errors), "tokens": st["tokens"],
            "tokens_per_s": st["tokens"] / span, "itl_ms": percentiles(gaps), "cpu": cpu,
            "rss_kib_before": rss0, "rss_kib": rss}


def client_main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    run = _slow_client_run if spec.get("mode") == "slow" else _client_run
    result = asyncio.run(run(spec))
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


# ---------------------------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------------------------

def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]  # (host, port) for AF_INET
        return port


NICE = 0  # set from --nice before any child starts


def _preexec(cpus: set[int] | None) -> Callable[[], None]:
    nice = NICE

    def fn() -> None:
        os.setsid()
        if nice:
            os.nice(nice)
        # Die with the benchmark even if it is killed hard (PR_SET_PDEATHSIG).
        with contextlib.suppress(OSError):  # pragma: no cover - non-glibc
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
        if cpus:
            os.sched_setaffinity(0, cpus)
    return fn


class Procs:
    """Child processes that must not outlive the benchmark."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], cpus: set[int] | None,
              env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.Popen[bytes]:
        with open(self.logdir / f"{name}.log", "ab") as log:  # the child keeps its own copy
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                                 preexec_fn=_preexec(cpus))
        self.procs.append((name, p))
        return p

    def check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None and name in ("sim", "gateway", "baseline", "nginx"):
                raise RuntimeError(f"{name} exited with status {p.returncode}; see "
                                   f"{self.logdir / (name + '.log')}:\n{self.tail(name)}")

    def tail(self, name: str, n: int = 30) -> str:
        try:
            lines = (self.logdir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop_all(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_http(procs: Procs, name: str, url: str, timeout: float = 30.0) -> None:
    """Until `url` answers HTTP at all (any status), or the process dies."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                r.read()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except (OSError, urllib.error.URLError) as e:
            last = e
        time.sleep(0.1)
    raise RuntimeError(f"{name} not ready at {url} after {timeout:.0f}s ({last}):\n"
                       f"{procs.tail(name)}")


def probe_stream(url: str, tokens: int) -> tuple[int, int]:
    """One streaming request: (HTTP status, number of content events)."""
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                       "stream": True, "max_tokens": tokens}).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": "Bearer bench",
        "x-sim-output-tokens": str(tokens)})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, 0
    n = 0
    for ev in data.split(b"\n\n"):
        j = ev.find(_CONTENT)
        if j >= 0 and ev[j + 11:j + 12] != b'"':
            n += 1
    return status, n


def parse_cpus(text: str | None, allowed: list[int], default: int | None) -> set[int] | None:
    if text is None:
        return None if default is None else {default}
    if text.lower() in ("none", "", "any"):
        return None
    cpus = {int(c) for c in text.split(",")}
    bad = cpus - set(allowed)
    if bad:
        raise SystemExit(f"CPU(s) {sorted(bad)} not available (allowed: {allowed})")
    return cpus


def fmt_cpus(c: set[int] | None) -> str:
    return "unpinned" if not c else "core " + ",".join(map(str, sorted(c)))


def run_json_process(procs: Procs, tmp: Path, tag: str, module: str, spec: dict[str, Any],
                     cpus: set[int] | None, limit_s: float,
                     during: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run `python -m module --client-spec SPEC --client-out OUT` (a load generator) to the
    end, within `limit_s`, while the benchmark's servers stay alive; return OUT's JSON."""
    spec_path, out_path = tmp / f"spec-{tag}.json", tmp / f"out-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    with contextlib.suppress(FileNotFoundError):
        out_path.unlink()
    p = procs.start(f"client-{tag}", [sys.executable, "-m", module,
                                      "--client-spec", str(spec_path),
                                      "--client-out", str(out_path)], cpus)
    try:
        if during is not None:
            during()
        deadline = time.monotonic() + limit_s
        while p.poll() is None:
            procs.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"load generator {tag} did not finish in {limit_s:.0f}s")
            time.sleep(0.1)
        if p.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"load generator {tag} failed ({p.returncode}):\n"
                               f"{procs.tail('client-' + tag)}")
        return load_json_object(out_path)
    finally:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def load_json_object(path: Path) -> dict[str, Any]:
    """A load generator's output: one JSON object (RuntimeError if it is anything else)."""
    obj = json.loads(path.read_text())
    if not isinstance(obj, dict):
        raise RuntimeError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def run_client(procs: Procs, tmp: Path, spec: dict[str, Any], cpus: set[int] | None,
               during: Callable[[], None] | None = None) -> dict[str, Any]:
    return run_json_process(procs, tmp, f"{spec['path']}-{spec['streams']}",
                            "benchmarks.overhead", spec, cpus,
                            spec["warmup"] + spec["duration"] + spec["grace"] + 30, during)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def overhead(direct: dict[str, Any], gw: dict[str, Any]) -> dict[str, Any]:
    gcpu = gw["cpu"].get("gateway", {})
    out = {
        "added_ttft_ms": {k: _diff(gw["ttft_ms"][k], direct["ttft_ms"][k])
                          for k in ("p50", "p90", "p99", "p99.9", "mean")},
        "added_itl_ms": {k: _diff(gw["itl_ms"][k], direct["itl_ms"][k])
                         for k in ("p50", "p90", "p99", "p99.9", "mean")},
        "added_headers_ms": {k: _diff(gw["headers_ms"][k], direct["headers_ms"][k])
                             for k in ("p50", "p99")},
        "added_first_byte_ms": {k: _diff(gw["first_byte_ms"][k], direct["first_byte_ms"][k])
                                for k in ("p50", "p99")},
        "gateway_cpu_sys_share": (gcpu["sys_s"] / gcpu["cpu_s"]
                                  if gcpu.get("cpu_s") and gcpu.get("sys_s") is not None
                                  else None),
        "tokens_per_s_ratio": (gw["tokens_per_s"] / direct["tokens_per_s"]
                               if direct["tokens_per_s"] else None),
        "gateway_cpu_us_per_token": None,
        "gateway_cpu_us_per_token_schedstat": None,
        "gateway_cpu_util": gcpu.get("util"),
        "gateway_rss_mib": (gw["rss_kib"].get("gateway") or 0) / 1024 or None,
    }
    if gw["tokens"]:
        if gcpu.get("cpu_s") is not None:
            out["gateway_cpu_us_per_token"] = gcpu["cpu_s"] / gw["tokens"] * 1e6
        if gcpu.get("cpu_s_schedstat") is not None:
            out["gateway_cpu_us_per_token_schedstat"] = gcpu["cpu_s_schedstat"] / gw["tokens"] * 1e6
    return out


class ProfileSummary(TypedDict):
    """Top frames of a py-spy profile: (frame, share of samples) pairs, most first."""

    samples: int
    self: list[tuple[str, float]]
    self_by_function: list[tuple[str, float]]
    self_by_group: list[tuple[str, float]]
    inclusive: list[tuple[str, float]]


def summarize_collapsed(path: Path, top: int = 20) -> ProfileSummary:
    """Top frames by self and by inclusive share of samples from a py-spy `--format raw` file
    (collapsed stacks: `frame;frame;... count`)."""
    self_c: Counter[str] = Counter()
    incl_c: Counter[str] = Counter()
    func_c: Counter[str] = Counter()
    group_c: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        frames = stack.split(";")
        total += n
        self_c[frames[-1]] += n
        func_c[_func(frames[-1])] += n
        group_c[_group(frames[-1])] += n
        for f in {_func(f) for f in frames}:
            incl_c[f] += n
    if not total:
        return {"self": [], "self_by_function": [], "self_by_group": [], "inclusive": [],
                "samples": 0}
    return {
        "samples": total,
        "self": [(f, c / total) for f, c in self_c.most_common(top)],
        "self_by_function": [(f, c / total) for f, c in func_c.most_common(top)],
        "self_by_group": [(g, c / total) for g, c in group_c.most_common()],
        # Frames on (nearly) every stack (the event loop's entry points) say nothing.
        "inclusive": [(f, c / total) for f, c in incl_c.most_common()
                      if c / total < 0.97 and ".py" in f][:top],
    }


def _group(frame: str) -> str:
    """Where a sample's innermost frame lives."""
    if "(gateway/" in frame or "(backends/" in frame:
        return "slogate code (gateway/, backends/)"
    if "aiohttp/" in frame or "(_http_" in frame or "multidict" in frame or "yarl" in frame:
        return "aiohttp (+ multidict/yarl)"
    if "(libc" in frame or frame.startswith(("read ", "write ", "epoll", "send", "recv")):
        return "syscalls (libc)"
    if ".c:" in frame or ".h:" in frame or ".c)" in frame or ".h)" in frame or ".so" in frame:
        return "native: uvloop/libuv/CPython/orjson"
    return "other Python (stdlib, OTel, prometheus-client)"


def _func(frame: str) -> str:
    """`name (file.py:123)` → `name (file.py)`: one entry per function, not per line."""
    head, sep, tail = frame.rpartition(":")
    return f"{head})" if sep and tail.rstrip(")").isdigit() else frame


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


PROXY_LABELS = {"gateway": "slogate", "baseline": "slogate (baseline)", "nginx": "nginx"}


def median_tree(items: list[Any]) -> Any:
    """The element-wise median of results of the same shape (numbers: median of those that are
    not None; anything else: the first one's)."""
    first = items[0]
    if isinstance(first, dict):
        return {k: median_tree([it.get(k) if isinstance(it, dict) else None for it in items])
                for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        vals = [v for v in items if isinstance(v, (int, float))]
        return statistics.median(vals) if vals else None
    if first is None:
        vals = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return statistics.median(vals) if vals else None
    return first


def render(results: dict[str, Any]) -> str:
    m = results["meta"]
    proxies = m.get("proxies", ["gateway"])
    reps = m.get("reps", 1)
    labels = dict(PROXY_LABELS)
    if m.get("baseline"):
        labels["baseline"] = f"slogate {m['baseline']}"
    lines = [
        f"### slogate streaming overhead — {m['tokens']} tokens at {m['token_ms']} ms/token, "
        f"{m['duration_s']:g} s per point (+{m['warmup_s']:g} s warm-up)"
        + (f", {reps} interleaved repetitions (medians)" if reps > 1 else ""),
        "",
        f"Placement: proxies {m['placement']['gateway']}; sim {m['placement']['sim']}; "
        f"load generator {m['placement']['client']} (separate process). "
        f"Telemetry: {m['telemetry']}. Nice: {m.get('nice', 0)}. "
        f"Host: {m['host']['cpus']} CPUs ({m['host']['cpu_model']}), "
        f"load avg at start {m['host']['loadavg_start']}. Git: {m.get('git')}.",
        "",
    ]
    if results["points"]:
        lines += [
            "| streams | path | reqs | err | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | tok/s "
            "| +TTFT p50 | +TTFT p99 | +ITL p50 | +ITL p99 | tok/s vs direct "
            "| µs/token | RSS MiB | CPU % [run-queue wait %] |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for pt in results["points"]:
        d = pt["direct"]
        lines.append(
            f"| {pt['streams']} | direct | {d['requests']:.0f} | {d['errors']:.0f} "
            f"| {fmt(d['ttft_ms']['p50'])} | {fmt(d['ttft_ms']['p99'])} "
            f"| {fmt(d['itl_ms']['p50'])} | {fmt(d['itl_ms']['p99'])} | {d['tokens_per_s']:.0f} "
            f"| | | | | | | | sim {_pc(d['cpu'], 'sim')} |")
        for px in proxies:
            g, o = pt[px], pt["overheads"][px]
            lines.append(
                f"| {pt['streams']} | {labels.get(px, px)} | {g['requests']:.0f} "
                f"| {g['errors']:.0f} "
                f"| {fmt(g['ttft_ms']['p50'])} | {fmt(g['ttft_ms']['p99'])} "
                f"| {fmt(g['itl_ms']['p50'])} | {fmt(g['itl_ms']['p99'])} "
                f"| {g['tokens_per_s']:.0f} "
                f"| {fmt(o['added_ttft_ms']['p50'])} | {fmt(o['added_ttft_ms']['p99'])} "
                f"| {fmt(o['added_itl_ms']['p50'])} | {fmt(o['added_itl_ms']['p99'])} "
                f"| {fmt(o['tokens_per_s_ratio'], '.3f')}× "
                f"| {fmt(o['gateway_cpu_us_per_token'], '.1f')} "
                f"| {fmt(o['gateway_rss_mib'], '.1f')} | {_pc(g['cpu'], 'gateway')} |")
    if results["points"]:
        lines += [
            "",
            "Times in ms, measured at the client. TTFT = request sent → first non-empty "
            "delta.content event; ITL = gap between successive content events. "
            "+X = proxy percentile − direct percentile (each repetition against the direct run "
            "next to it, then the median). µs/token = the proxy's utime+stime (/proc/PID/stat; "
            "nginx: its worker) over the window ÷ tokens streamed through it. CPU % = of one "
            "core; in brackets the time the process was runnable but waiting for its core "
            "(schedstat run-queue wait, % of the window): a large wait means other work on the "
            "machine, and the latency columns then measure that.",
        ]
    slow = results.get("slow") or []
    if slow:
        lines += [
            "",
            f"**Long-lived slow streams**: N streams open at once, one token per "
            f"{m.get('slow_token_ms', 1000):g} ms each, measured over "
            f"{m.get('slow_duration_s', 0):g} s once all are open.",
            "",
            "| streams | proxy | open | err | tok/s | ITL p50 | ITL p99 | CPU % of a core "
            "[run-queue wait %] | µs/token | CPU µs/s per stream | RSS MiB idle → loaded "
            "| RSS KiB per stream |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for pt in slow:
            for px in proxies:
                r = pt.get(px)
                if r is None:
                    continue
                c = r["cpu"].get("gateway", {})
                n = r["streams"]
                rb = (r["rss_kib_before"].get("gateway") or 0)
                ra = (r["rss_kib"].get("gateway") or 0)
                us_tok = (c["cpu_s"] / r["tokens"] * 1e6
                          if c.get("cpu_s") is not None and r["tokens"] else None)
                per_stream = (c["cpu_s"] / r["window_s"] / n * 1e6
                              if c.get("cpu_s") is not None else None)
                lines.append(
                    f"| {n} | {labels.get(px, px)} | {r['streams_open']} | {r['errors']} "
                    f"| {r['tokens_per_s']:.0f} | {fmt(r['itl_ms']['p50'], '.0f')} "
                    f"| {fmt(r['itl_ms']['p99'], '.0f')} | {_pc(r['cpu'], 'gateway')} "
                    f"| {fmt(us_tok, '.1f')} | {fmt(per_stream, '.1f')} "
                    f"| {rb / 1024:.1f} → {ra / 1024:.1f} | {(ra - rb) / n:.1f} |")
    prof = results.get("profile")
    if prof and prof.get("summary"):
        s = prof["summary"]
        lines += ["", f"py-spy at {prof['streams']} streams ({s['samples']} samples, "
                      f"flame graph {prof.get('svg')}): self time by where it is spent", ""]
        for g, share in s.get("self_by_group", []):
            lines.append(f"- {share * 100:5.1f}%  {g}")
        lines += ["", "self time by function:", ""]
        for f, share in s["self_by_function"][:12]:
            lines.append(f"- {share * 100:5.1f}%  {f}")
        lines += ["", "inclusive time by function:", ""]
        for f, share in s["inclusive"][:15]:
            lines.append(f"- {share * 100:5.1f}%  {f}")
    return "\n".join(lines)


def _pc(cpu: dict[str, Any], name: str) -> str:
    u = cpu.get(name, {}).get("util")
    w = cpu.get(name, {}).get("runq_wait_frac")
    return (("–" if u is None else f"{u * 100:.0f}")
            + ("" if w is None else f" [{w * 100:.0f}]"))


NGINX_CONF = """
daemon off;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections {conns}; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  upstream sim {{ server {host}:{sim_port}; keepalive {keepalive}; }}
  server {{
    listen {host}:{port};
    location / {{
      proxy_pass http://sim;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""


def start_nginx(procs: Procs, tmp: Path, host: str, port: int, sim_port: int,
                cpus: set[int] | None, conns: int) -> tuple[subprocess.Popen[bytes], int]:
    """nginx (one worker, proxy_buffering off) in front of the simulator: (master, worker pid)."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        raise RuntimeError("nginx is not installed (make system-deps)")
    ndir = tmp / "nginx"
    ndir.mkdir(exist_ok=True)
    conf = ndir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=ndir, host=host, port=port, sim_port=sim_port,
                                      conns=max(1024, 2 * conns + 64),
                                      nofile=max(4096, 4 * conns + 256),
                                      keepalive=max(64, conns)))
    master = procs.start("nginx", [binary, "-c", str(conf), "-p", str(ndir)], cpus)
    wait_http(procs, "nginx", f"http://{host}:{port}/v1/models")
    worker = None
    for _ in range(50):
        with contextlib.suppress(OSError, ValueError):
            kids = Path(f"/proc/{master.pid}/task/{master.pid}/children").read_text().split()
            if kids:
                worker = int(kids[0])
                break
        time.sleep(0.1)
    if worker is None:
        raise RuntimeError("nginx worker not found")
    return master, worker


def gateway_config(host: str, port: int, sim_port: int, pool: int | None, extra: str,
                   server_extra: str = "") -> str:
    """The gateway's TOML: access log off, open auth, one backend (the sim). Versions of the
    gateway that predate a section reject it, so the first candidate that this checkout's
    config parser accepts is used (the plain one when the parser cannot be imported).
    pool None: the backend's default pool size."""
    server = f'[server]\nhost = "{host}"\nport = {port}\naccess_log = false\n{server_extra}\n'
    auth = '[auth]\nmode = "open"\n\n'
    backend = (f'[[backends]]\nname = "sim"\ntype = "openai"\n'
               f'base_url = "http://{host}:{sim_port}/v1"\nmodels = ["*"]\n'
               + ("" if pool is None else f"pool_size = {pool}\n")
               # the requests force their lengths with x-sim-output-tokens
               + 'forward_headers = ["x-sim-*"]\n')
    candidates = [server + auth + backend + extra, server + backend + extra]
    try:
        import tomllib

        sys.path.insert(0, str(REPO))
        from gateway import config as gw_config
    except Exception:
        return candidates[0]
    finally:
        if sys.path and sys.path[0] == str(REPO):
            sys.path.pop(0)
    for text in candidates:
        try:
            gw_config.parse(tomllib.loads(text), {})
            return text
        except Exception:
            continue
    return candidates[0]


def git_rev() -> str | None:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", help="concurrency levels (default 1,8,64,256)")
    ap.add_argument("--duration", type=float,
                    help="seconds measured per point and path (default 10)")
    ap.add_argument("--warmup", type=float, help="seconds of load before each window (default 2)")
    ap.add_argument("--tokens", type=int, default=100, help="content tokens per response")
    ap.add_argument("--token-ms", type=float, default=2.0, help="sim decode step (ms per token)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: streams 1,8, 3 s per point, 1 s warm-up (unless given)")
    ap.add_argument("--out", default="bench-results/overhead.json",
                    help="JSON results (default %(default)s)")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--gateway-cmd", default=DEFAULT_GATEWAY_CMD,
                    help="gateway command template; placeholders {python} {config} {host} {port} "
                         "(default: %(default)s)")
    ap.add_argument("--sim-cmd", default=DEFAULT_SIM_CMD,
                    help="simulator command template; placeholders {python} {host} {port} "
                         "{token_ms} {max_batch} (default: %(default)s)")
    ap.add_argument("--gateway-config-extra", metavar="FILE",
                    help="TOML appended to the generated gateway config (e.g. a [telemetry] table)")
    ap.add_argument("--telemetry", choices=("on", "off"),
                    help="on: OTLP spans + metrics exported to a local sink, Prometheus on; "
                         "off: no export and no Prometheus observation; unset: the defaults "
                         "(Prometheus on, nothing exported)")
    ap.add_argument("--gateway-cpu", help="CPU list for the gateway (default: the 2nd allowed CPU; "
                                          "'none' = unpinned)")
    ap.add_argument("--sim-cpu", help="CPU list for the simulator (default: the 1st allowed CPU)")
    ap.add_argument("--client-cpu",
                    help="CPU list for the load generator (default: same as the sim)")
    ap.add_argument("--profile", metavar="DIR",
                    help="also run py-spy on the gateway at the 64-stream point (an extra, "
                         "unmeasured pass): DIR/gateway-<streams>.svg and a raw collapsed-stack "
                         "file summarized into top frames")
    ap.add_argument("--profile-streams", type=int, default=64, help="point to profile (default 64)")
    ap.add_argument("--profile-native", action="store_true", help="py-spy --native (C frames too)")
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness for the sim, gateway and load generator (negative needs root; "
                         "e.g. -5 on a machine shared with other work, to cut run-queue waits)")
    ap.add_argument("--proxies", default=None,
                    help="proxies measured against direct, in this order within each repetition: "
                         "gateway (this checkout), nginx (proxy_buffering off), baseline (the "
                         "--baseline revision) (default: gateway,nginx[,baseline])")
    ap.add_argument("--baseline", metavar="REV",
                    help="also run the gateway of this git revision (exported with git archive), "
                         "same config and placement, interleaved with this checkout's")
    ap.add_argument("--reps", type=int, default=1,
                    help="repetitions per point, interleaved (direct, A, B, direct, A, B, ...); "
                         "the tables show medians")
    ap.add_argument("--slow", metavar="N,N",
                    help="long-lived slow streams mode: these numbers of concurrent streams, "
                         "one token per --slow-token-ms (e.g. 1000,5000)")
    ap.add_argument("--slow-token-ms", type=float, default=1000.0)
    ap.add_argument("--slow-duration", type=float, default=20.0,
                    help="seconds measured once all slow streams are open (default 20)")
    ap.add_argument("--slow-ramp", type=float, default=None,
                    help="seconds over which the slow streams are opened (default N/500)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--keep-logs", action="store_true", help="keep the temp dir with process logs")
    ap.add_argument("--client-spec", help=argparse.SUPPRESS)
    ap.add_argument("--client-out", help=argparse.SUPPRESS)
    from benchmarks import paced
    paced.add_arguments(ap)
    args = ap.parse_args(argv)

    if args.client_spec:
        return client_main(args.client_spec, args.client_out)
    global NICE
    NICE = args.nice

    quick = args.quick
    if args.streams is None:
        args.streams = "1,8" if quick else ("" if args.slow else "1,8,64,256")
    if args.duration is None:
        args.duration = 3.0 if quick else 10.0
    if args.warmup is None:
        args.warmup = 1.0 if quick else 2.0
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    slow_counts = [int(s) for s in (args.slow or "").split(",") if s.strip()]
    if args.proxies is None:
        args.proxies = "gateway" + (",nginx" if shutil.which("nginx") or
                                    Path("/usr/sbin/nginx").exists() else "")
        if args.baseline:
            args.proxies += ",baseline"
    proxies = [p.strip() for p in args.proxies.split(",") if p.strip()]
    if "baseline" in proxies and not args.baseline:
        raise SystemExit("--proxies baseline needs --baseline REV")
    reps = max(1, args.reps)
    if slow_counts and streams:
        raise SystemExit("--slow runs on its own (the simulator's decode step is the slow "
                         "token interval): give no --streams with it")
    if slow_counts:
        args.token_ms = args.slow_token_ms
    allowed = sorted(os.sched_getaffinity(0))
    two = len(allowed) >= 2
    gw_cpus = parse_cpus(args.gateway_cpu, allowed, allowed[1] if two else None)
    sim_cpus = parse_cpus(args.sim_cpu, allowed, allowed[0] if two else None)
    client_cpus = parse_cpus(args.client_cpu, allowed, None) if args.client_cpu else sim_cpus
    placement = {"gateway": fmt_cpus(gw_cpus), "sim": fmt_cpus(sim_cpus),
                 "client": fmt_cpus(client_cpus)}
    lane = {"gateway": gw_cpus, "sim": sim_cpus, "client": client_cpus}
    if args.paced:
        return paced.run_lane(args, lane)

    tmp = Path(tempfile.mkdtemp(prefix="slogate-bench-"))
    procs = Procs(tmp)
    host = args.host
    sim_port, gw_port = free_port(host), free_port(host)
    most = max(streams + slow_counts)
    max_batch = max(1024, 2 * most)
    cfg_path = tmp / "gateway.toml"
    extra = Path(args.gateway_config_extra).read_text() if args.gateway_config_extra else ""
    sink_port = free_port(host)
    if args.telemetry == "on":  # spans and OTLP metrics exported (to a sink), Prometheus on
        extra += (f'\n[telemetry]\notlp_endpoint = "http://{host}:{sink_port}"\n'
                  'metrics_export_interval_s = 5\n')
    elif args.telemetry == "off":  # nothing exported, no Prometheus observation either
        extra += "\n[telemetry]\ntraces = false\notlp_metrics = false\nprometheus = false\n"
    server_extra = ""
    if slow_counts:  # thousands of connections from one address
        server_extra = (f"max_connections = {4 * most + 1024}\n"
                        "max_connections_per_client = 0\n")
    cfg_path.write_text(gateway_config(host, gw_port, sim_port, max(256, 2 * most), extra,
                                       server_extra))
    ports = {"gateway": gw_port, "baseline": free_port(host), "nginx": free_port(host)}
    subst = {"python": shlex.quote(sys.executable), "host": host, "config": str(cfg_path),
             "token_ms": f"{args.token_ms:g}", "max_batch": str(max_batch)}
    sim_argv = shlex.split(args.sim_cmd.format(**subst, port=sim_port))
    gw_argv = shlex.split(args.gateway_cmd.format(**subst, port=gw_port))
    gw_env = dict(os.environ)

    results: dict[str, Any] = {
        "meta": {
            "benchmark": "overhead",
            "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "git": git_rev(),
            "tokens": args.tokens, "token_ms": args.token_ms,
            "duration_s": args.duration, "warmup_s": args.warmup, "streams": streams,
            "placement": placement, "nice": args.nice,
            "telemetry": args.telemetry or "unset",
            "sim_cmd": sim_argv, "gateway_cmd": gw_argv,
            "host": {"cpus": os.cpu_count(), "allowed_cpus": allowed, "cpu_model": cpu_model(),
                     "loadavg_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
                     "python": platform.python_version(), "kernel": platform.release()},
            "method": "closed loop, one client process (aiohttp+uvloop) per point/path; TTFT to "
                      "first non-empty delta.content event; CPU from /proc/PID/stat",
        },
        "points": [],
    }

    def on_signal(signum: int, frame: FrameType | None) -> None:  # SIGTERM runs the cleanup too
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_signal)

    ok = False
    try:
        print(f"placement: gateway {placement['gateway']}, sim {placement['sim']}, "
              f"load generator {placement['client']}; logs in {tmp}", flush=True)
        sim = procs.start("sim", sim_argv, sim_cpus)
        if args.telemetry == "on":
            procs.start("otlp-sink", [sys.executable, "-m", "benchmarks.otlp_sink", "--host", host,
                                      "--port", str(sink_port)], sim_cpus)
        wait_http(procs, "sim", f"http://{host}:{sim_port}/v1/models")
        urls = {"direct": f"http://{host}:{sim_port}/v1/chat/completions"}
        pids: dict[str, int] = {}
        gw = None
        for px in proxies:
            port = ports[px]
            if px == "nginx":
                _, pids[px] = start_nginx(procs, tmp, host, port, sim_port, gw_cpus, most)
            elif px in ("gateway", "baseline"):
                cwd = REPO
                argv = gw_argv
                if px == "baseline":  # that revision's tree, its own working directory
                    cwd = tmp / "baseline"
                    cwd.mkdir()
                    archive = subprocess.run(["git", "archive", args.baseline], cwd=REPO,
                                             capture_output=True, check=True).stdout
                    subprocess.run(["tar", "-x", "-C", str(cwd)], input=archive, check=True)
                    argv = shlex.split(args.gateway_cmd.format(**subst, port=port))
                    results["meta"]["baseline_git"] = subprocess.run(
                        ["git", "rev-parse", "--short", args.baseline], cwd=REPO, text=True,
                        capture_output=True).stdout.strip()
                env = dict(gw_env)
                if px == "baseline":
                    env["PYTHONPATH"] = str(cwd)
                proc = procs.start(px, argv, gw_cpus, env=env, cwd=cwd)
                wait_http(procs, px, f"http://{host}:{port}/healthz")
                pids[px] = proc.pid
                if px == "gateway":
                    gw = proc
            else:
                raise SystemExit(f"unknown proxy {px!r}")
            urls[px] = f"http://{host}:{port}/v1/chat/completions"
        probe_tokens = 2 if slow_counts else args.tokens
        for path, url in urls.items():
            status, n = probe_stream(url, probe_tokens)
            if status != 200 or n != probe_tokens:
                raise RuntimeError(f"probe via {path}: HTTP {status}, {n} content events "
                                   f"(expected 200 and {probe_tokens}); logs in {tmp}")
        results["meta"]["pids"] = {"sim": sim.pid, **pids}
        results["meta"]["proxies"] = proxies
        results["meta"]["reps"] = reps
        results["meta"]["baseline"] = args.baseline
        first_proxy = pids[proxies[0]] if proxies else None

        def spec_for(path: str, n: int, rep: int = 0) -> dict[str, Any]:
            watch = {"sim": sim.pid}
            target = pids.get(path, first_proxy)
            if target is not None:
                watch["gateway"] = target
            return {"path": f"{path}-r{rep}", "url": urls[path], "streams": n,
                    "warmup": args.warmup, "duration": args.duration, "tokens": args.tokens,
                    "token_ms": args.token_ms, "grace": 10.0, "watch": watch}

        for n in streams:
            point: dict[str, Any] = {"streams": n, "runs": {p: [] for p in ("direct", *proxies)}}
            for rep in range(reps):
                for path in ("direct", *proxies):
                    print(f"[{n:>4} streams] {path:<8} rep {rep + 1}/{reps} …", end=" ",
                          flush=True)
                    r = run_client(procs, tmp, spec_for(path, n, rep), client_cpus)
                    point["runs"][path].append(r)
                    waits = ", ".join(f"{k} {v['runq_wait_frac'] * 100:.0f}%"
                                      for k, v in r["cpu"].items()
                                      if v.get("runq_wait_frac") is not None
                                      and (k != "gateway" or path != "direct"))
                    cpu_tok = ""
                    g = r["cpu"].get("gateway", {})
                    if path != "direct" and g.get("cpu_s") is not None and r["tokens"]:
                        cpu_tok = f", {g['cpu_s'] / r['tokens'] * 1e6:.1f} µs/token"
                    print(f"{r['tokens_per_s']:.0f} tok/s, TTFT p50 {fmt(r['ttft_ms']['p50'])} "
                          f"ms, ITL p99 {fmt(r['itl_ms']['p99'])} ms, errors {r['errors']}"
                          f"{cpu_tok}; run-queue wait: {waits}"
                          + (f"; {r['short_streams']} streams with a token count other than "
                             f"{args.tokens}" if r["short_streams"] else "")
                          + (f"; errors: {r['error_kinds']}" if r["error_kinds"] else ""),
                          flush=True)
            runs = point["runs"]
            for path in ("direct", *proxies):
                point[path] = median_tree(runs[path])
            point["overheads"] = {
                px: median_tree([overhead(d, g) for d, g in zip(runs["direct"], runs[px],
                                                                strict=True)])
                for px in proxies}
            if "gateway" in proxies:
                point["overhead"] = point["overheads"]["gateway"]
            for px in proxies:
                o = point["overheads"][px]
                print(f"               → {px}: +TTFT p50 {fmt(o['added_ttft_ms']['p50'])} ms, "
                      f"p99 {fmt(o['added_ttft_ms']['p99'])} ms, "
                      f"{fmt(o['gateway_cpu_us_per_token'], '.1f')} µs/token, "
                      f"ratio {fmt(o['tokens_per_s_ratio'], '.3f')} (medians)", flush=True)
            results["points"].append(point)

            if args.profile and n == args.profile_streams and gw is not None:
                results["profile"] = profile_point(args, procs, tmp, spec_for("gateway", n),
                                                   client_cpus, gw.pid)
        results["slow"] = []
        results["meta"]["slow_token_ms"] = args.slow_token_ms
        results["meta"]["slow_duration_s"] = args.slow_duration
        for n in slow_counts:
            spt: dict[str, Any] = {"streams": n}
            for px in proxies:
                spec = spec_for(px, n)
                ramp = args.slow_ramp if args.slow_ramp is not None else max(2.0, n / 500)
                # Long enough to outlast the run; the sim's decode step is the token interval.
                spec.update(mode="slow", ramp=ramp, warmup=3.0, duration=args.slow_duration,
                            tokens=int((ramp + 45 + args.slow_duration) * 1000
                                       / args.slow_token_ms) + 10,
                            path=f"slow-{px}")
                print(f"[{n:>5} slow streams] {px:<8} …", end=" ", flush=True)
                r = run_json_process(procs, tmp, f"slow-{px}-{n}", "benchmarks.overhead", spec,
                                     client_cpus, ramp + 45 + args.slow_duration + 60)
                spt[px] = r
                c = r["cpu"].get("gateway", {})
                rb = r["rss_kib_before"].get("gateway") or 0
                ra = r["rss_kib"].get("gateway") or 0
                util = (c.get("util") or 0) * 100
                print(f"{r['streams_open']} open, {r['errors']} errors, "
                      f"{r['tokens_per_s']:.0f} tok/s, CPU {util:.1f}%"
                      f" [wait {fmt((c.get('runq_wait_frac') or 0) * 100, '.0f')}%], RSS "
                      f"{rb / 1024:.1f} → {ra / 1024:.1f} MiB ({(ra - rb) / n:.1f} KiB/stream)"
                      + (f"; errors: {r['error_kinds']}" if r["error_kinds"] else ""),
                      flush=True)
                time.sleep(3)  # let the closed streams wind down
            results["slow"].append(spt)
        if args.profile and "profile" not in results:
            print(f"note: --profile given but {args.profile_streams} is not among the "
                  f"streams {streams}; nothing profiled", file=sys.stderr)
        ok = True
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"\nbenchmark failed: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        if ok and not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not ok:
            print(f"process logs kept in {tmp}", file=sys.stderr)

    results["meta"]["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    table = render(results)
    print()
    print(table)
    print(f"\nresults: {out}")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.no_paced or slow_counts or args.baseline:
        return 0
    print()
    return paced.run_lane(args, lane)


def profile_point(args: argparse.Namespace, procs: Procs, tmp: Path, spec: dict[str, Any],
                  client_cpus: set[int] | None, gw_pid: int) -> dict[str, Any]:
    """An extra gateway pass with py-spy attached (not part of the measured numbers): once for
    the flame graph, once in raw collapsed-stack format for the top-frames summary."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(pyspy).exists():
        print("note: py-spy not found (pip install py-spy into the venv); no profile",
              file=sys.stderr)
        return {"error": "py-spy not installed"}
    outdir = Path(args.profile)
    outdir.mkdir(parents=True, exist_ok=True)
    n = spec["streams"]
    secs = max(1, int(round(spec["duration"])))
    svg = outdir / f"gateway-{n}.svg"
    raw = outdir / f"gateway-{n}.txt"
    native = ["--native"] if args.profile_native else []
    info: dict[str, Any] = {"streams": n, "svg": str(svg), "raw": str(raw), "seconds": secs}
    for fmt_name, dest in (("flamegraph", svg), ("raw", raw)):
        argv = [pyspy, "record", "--pid", str(gw_pid), "--duration", str(secs), "--rate", "250",
                "--format", fmt_name, "-o", str(dest), *native]
        holder: dict[str, subprocess.Popen[bytes]] = {}

        def during(holder: dict[str, subprocess.Popen[bytes]] = holder, fmt_name: str = fmt_name,
                   argv: list[str] = argv) -> None:
            time.sleep(spec["warmup"])
            holder["p"] = procs.start(f"py-spy-{fmt_name}", argv, client_cpus)

        print(f"[{n:>4} streams] py-spy {fmt_name} pass …", flush=True)
        run_client(procs, tmp, {**spec, "path": f"profile-{fmt_name}"}, client_cpus, during)
        p = holder.get("p")
        if p is not None:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
            if p.returncode != 0:
                print(f"py-spy failed ({p.returncode}):\n{procs.tail('py-spy-' + fmt_name)}",
                      file=sys.stderr)
    if raw.exists():
        info["summary"] = summarize_collapsed(raw)
    return info


if __name__ == "__main__":
    sys.exit(main())
