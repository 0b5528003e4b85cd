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
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

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


def percentiles(values: list[float], pcts=PCTS) -> dict[str, float | None]:
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


def client_main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    result = asyncio.run(_client_run(spec))
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


# ---------------------------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------------------------

def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


NICE = 0  # set from --nice before any child starts


def _preexec(cpus: set[int] | None):
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
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], cpus: set[int] | None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.logdir / f"{name}.log", "ab") as log:  # the child keeps its own copy
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=REPO, env=env,
                                 preexec_fn=_preexec(cpus))
        self.procs.append((name, p))
        return p

    def check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None and name in ("sim", "gateway"):
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
                     cpus: set[int] | None, limit_s: float, during=None) -> dict[str, Any]:
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
        return json.loads(out_path.read_text())
    finally:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_client(procs: Procs, tmp: Path, spec: dict[str, Any], cpus: set[int] | None,
               during=None) -> dict[str, Any]:
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


def summarize_collapsed(path: Path, top: int = 20) -> dict[str, list[tuple[str, float]]]:
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


def render(results: dict[str, Any]) -> str:
    m = results["meta"]
    lines = [
        f"### slogate streaming overhead — {m['tokens']} tokens at {m['token_ms']} ms/token, "
        f"{m['duration_s']:g} s per point (+{m['warmup_s']:g} s warm-up)",
        "",
        f"Placement: gateway {m['placement']['gateway']}; sim {m['placement']['sim']}; "
        f"load generator {m['placement']['client']} (separate process). "
        f"Telemetry: {m['telemetry']}. Nice: {m.get('nice', 0)}. "
        f"Host: {m['host']['cpus']} CPUs ({m['host']['cpu_model']}), "
        f"load avg at start {m['host']['loadavg_start']}.",
        "",
        "| streams | path | reqs | err | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | tok/s "
        "| +TTFT p50 | +TTFT p99 | +ITL p50 | +ITL p99 | tok/s vs direct "
        "| GW µs/token | GW RSS MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for pt in results["points"]:
        d, g, o = pt["direct"], pt["gateway"], pt["overhead"]
        lines.append(
            f"| {pt['streams']} | direct | {d['requests']} | {d['errors']} "
            f"| {fmt(d['ttft_ms']['p50'])} | {fmt(d['ttft_ms']['p99'])} "
            f"| {fmt(d['itl_ms']['p50'])} | {fmt(d['itl_ms']['p99'])} | {d['tokens_per_s']:.0f} "
            f"| | | | | | | |")
        lines.append(
            f"| {pt['streams']} | gateway | {g['requests']} | {g['errors']} "
            f"| {fmt(g['ttft_ms']['p50'])} | {fmt(g['ttft_ms']['p99'])} "
            f"| {fmt(g['itl_ms']['p50'])} | {fmt(g['itl_ms']['p99'])} | {g['tokens_per_s']:.0f} "
            f"| {fmt(o['added_ttft_ms']['p50'])} | {fmt(o['added_ttft_ms']['p99'])} "
            f"| {fmt(o['added_itl_ms']['p50'])} | {fmt(o['added_itl_ms']['p99'])} "
            f"| {fmt(o['tokens_per_s_ratio'], '.3f')}× "
            f"| {fmt(o['gateway_cpu_us_per_token'], '.1f')} "
            f"| {fmt(o['gateway_rss_mib'], '.1f')} |")
    lines += [
        "",
        "Times in ms, measured at the client. TTFT = request sent → first non-empty "
        "delta.content event; ITL = gap between successive content events. "
        "+X = gateway percentile − direct percentile. GW µs/token = gateway utime+stime "
        "(/proc/PID/stat) over the window ÷ tokens streamed through it.",
        "",
        "CPU use during the window, as % of one core, and in brackets the time the process "
        "was runnable but waiting for its core (schedstat run-queue wait, % of the window). "
        "A saturated core, or a large wait (other work on the machine), makes the latency "
        "columns above a measurement of that, not of the gateway. µs/token is affected less, but "
        "it falls when the gateway runs late (more events per read and per write): compare it "
        "between runs with similar waits.",
        "",
        "| streams | path | gateway CPU % | sim CPU % | load generator CPU % "
        "| headers p50 | first byte p50 | +headers p50 | +first byte p50 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for pt in results["points"]:
        for path in ("direct", "gateway"):
            r = pt[path]
            c = r["cpu"]

            def pc(name: str, c: dict[str, Any] = c) -> str:
                u = c.get(name, {}).get("util")
                w = c.get(name, {}).get("runq_wait_frac")
                return (("–" if u is None else f"{u * 100:.0f}")
                        + ("" if w is None else f" [{w * 100:.0f}]"))
            g = c.get("gateway", {})
            sys_share = (f", {g['sys_s'] / g['cpu_s'] * 100:.0f}% sys"
                         if path == "gateway" and g.get("cpu_s") else "")
            o = pt["overhead"]
            added = (f"| {fmt(o['added_headers_ms']['p50'])} "
                     f"| {fmt(o['added_first_byte_ms']['p50'])} |"
                     if path == "gateway" else "| | |")
            gw_cpu = pc("gateway") if path == "gateway" else "–"
            lines.append(f"| {pt['streams']} | {path} | {gw_cpu}{sys_share} | {pc('sim')} "
                         f"| {pc('client')} | {fmt(r['headers_ms']['p50'])} "
                         f"| {fmt(r['first_byte_ms']['p50'])} {added}")
    worst = max(((pt[path]["cpu"].get(name, {}).get("runq_wait_frac") or 0.0, pt["streams"],
                  path, name)
                 for pt in results["points"] for path in ("direct", "gateway")
                 for name in ("gateway", "sim", "client")
                 if name != "gateway" or path == "gateway"), default=None)
    if worst and worst[0] > 0.05:
        lines += ["", f"**Warning: CPU contention.** The {worst[3]} waited "
                      f"{worst[0] * 100:.0f}% of the window for its core ({worst[1]} streams, "
                      f"{worst[2]} path): other work "
                      f"on this machine (or the process sharing its core) kept it from running; "
                      f"latency and throughput numbers are not clean. Rerun on an idle machine "
                      f"(or with --nice -5)."]
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


def gateway_config(host: str, port: int, sim_port: int, pool: int, extra: str) -> str:
    """The gateway's TOML: access log off, open auth, one backend (the sim). Versions of the
    gateway that predate a section reject it, so the first candidate that this checkout's
    config parser accepts is used (the plain one when the parser cannot be imported)."""
    server = f'[server]\nhost = "{host}"\nport = {port}\naccess_log = false\n\n'
    auth = '[auth]\nmode = "open"\n\n'
    backend = (f'[[backends]]\nname = "sim"\ntype = "openai"\n'
               f'base_url = "http://{host}:{sim_port}/v1"\nmodels = ["*"]\npool_size = {pool}\n')
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
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--keep-logs", action="store_true", help="keep the temp dir with process logs")
    ap.add_argument("--client-spec", help=argparse.SUPPRESS)
    ap.add_argument("--client-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.client_spec:
        return client_main(args.client_spec, args.client_out)
    global NICE
    NICE = args.nice

    quick = args.quick
    if args.streams is None:
        args.streams = "1,8" if quick else "1,8,64,256"
    if args.duration is None:
        args.duration = 3.0 if quick else 10.0
    if args.warmup is None:
        args.warmup = 1.0 if quick else 2.0
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    allowed = sorted(os.sched_getaffinity(0))
    two = len(allowed) >= 2
    gw_cpus = parse_cpus(args.gateway_cpu, allowed, allowed[1] if two else None)
    sim_cpus = parse_cpus(args.sim_cpu, allowed, allowed[0] if two else None)
    client_cpus = parse_cpus(args.client_cpu, allowed, None) if args.client_cpu else sim_cpus
    placement = {"gateway": fmt_cpus(gw_cpus), "sim": fmt_cpus(sim_cpus),
                 "client": fmt_cpus(client_cpus)}

    tmp = Path(tempfile.mkdtemp(prefix="slogate-bench-"))
    procs = Procs(tmp)
    host = args.host
    sim_port, gw_port = free_port(host), free_port(host)
    max_batch = max(1024, 2 * max(streams))
    cfg_path = tmp / "gateway.toml"
    extra = Path(args.gateway_config_extra).read_text() if args.gateway_config_extra else ""
    sink_port = free_port(host)
    if args.telemetry == "on":  # spans and OTLP metrics exported (to a sink), Prometheus on
        extra += (f'\n[telemetry]\notlp_endpoint = "http://{host}:{sink_port}"\n'
                  'metrics_export_interval_s = 5\n')
    elif args.telemetry == "off":  # nothing exported, no Prometheus observation either
        extra += "\n[telemetry]\ntraces = false\notlp_metrics = false\nprometheus = false\n"
    cfg_path.write_text(gateway_config(host, gw_port, sim_port, max(256, 2 * max(streams)), extra))
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

    def on_signal(signum, frame):  # make SIGTERM run the cleanup too
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
        gw = procs.start("gateway", gw_argv, gw_cpus, env=gw_env)
        wait_http(procs, "gateway", f"http://{host}:{gw_port}/healthz")
        urls = {"direct": f"http://{host}:{sim_port}/v1/chat/completions",
                "gateway": f"http://{host}:{gw_port}/v1/chat/completions"}
        for path, url in urls.items():
            status, n = probe_stream(url, args.tokens)
            if status != 200 or n != args.tokens:
                raise RuntimeError(f"probe via {path}: HTTP {status}, {n} content events "
                                   f"(expected 200 and {args.tokens}); logs in {tmp}")
        results["meta"]["pids"] = {"sim": sim.pid, "gateway": gw.pid}
        watch = {"sim": sim.pid, "gateway": gw.pid}

        def spec_for(path: str, n: int) -> dict[str, Any]:
            return {"path": path, "url": urls[path], "streams": n, "warmup": args.warmup,
                    "duration": args.duration, "tokens": args.tokens,
                    "token_ms": args.token_ms, "grace": 10.0, "watch": watch}

        for n in streams:
            point: dict[str, Any] = {"streams": n}
            for path in ("direct", "gateway"):
                print(f"[{n:>4} streams] {path:<7} …", end=" ", flush=True)
                r = run_client(procs, tmp, spec_for(path, n), client_cpus)
                point[path] = r
                waits = ", ".join(f"{k} {v['runq_wait_frac'] * 100:.0f}%"
                                  for k, v in r["cpu"].items()
                                  if v.get("runq_wait_frac") is not None
                                  and (k != "gateway" or path == "gateway"))
                print(f"{r['tokens_per_s']:.0f} tok/s, TTFT p50 {fmt(r['ttft_ms']['p50'])} ms, "
                      f"ITL p99 {fmt(r['itl_ms']['p99'])} ms, errors {r['errors']}; "
                      f"run-queue wait: {waits}"
                      + (f"; {r['short_streams']} streams with a token count other than "
                         f"{args.tokens}" if r["short_streams"] else "")
                      + (f"; errors: {r['error_kinds']}" if r["error_kinds"] else ""), flush=True)
            point["overhead"] = overhead(point["direct"], point["gateway"])
            o = point["overhead"]
            print(f"               → +TTFT p50 {fmt(o['added_ttft_ms']['p50'])} ms, "
                  f"{fmt(o['gateway_cpu_us_per_token'], '.1f')} µs/token, "
                  f"ratio {fmt(o['tokens_per_s_ratio'], '.3f')}", flush=True)
            results["points"].append(point)

            if args.profile and n == args.profile_streams:
                results["profile"] = profile_point(args, procs, tmp, spec_for("gateway", n),
                                                   client_cpus, gw.pid)
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
    return 0


def profile_point(args, procs: Procs, tmp: Path, spec: dict[str, Any],
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
        holder: dict[str, subprocess.Popen] = {}

        def during(holder: dict[str, subprocess.Popen] = holder, fmt_name: str = fmt_name,
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
