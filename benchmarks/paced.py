#!/usr/bin/env python3
"""Paced-stream lane of `make bench`: direct, nginx and slogate side by side against a mock
engine that sends FRAMES content frames PACE ms apart after FIRST ms (64 × 20 ms after 20 ms:
a decode rate of 50 tokens/s per stream, what a served model streams to a person).

Two measurements, the same three targets in one run, each proxy pinned to the same core:

1. Latency at c=1 and c=8 (closed loop, REQUESTS sequential requests in all): TTFT p50/p99 and
   the inter-frame gap p50/p99, and each proxy's addition to them (proxy − direct).
2. Sustained streams: a ladder of concurrent paced streams (64, 256, 512, 1,024, 2,048, …).
   A rung is held when every request of the rung (ramp-up included: a refused connection
   counts) got all FRAMES frames, its first one within FIRST + 2 × PACE ms and no gap between
   frames over 2 × PACE; the figures are of the requests started in its window. Per rung: the
   target's CPU (% of its one core) and RSS, TTFT p99, and the load generator's own event-loop
   lag: when that lag goes over PACE / 4 the rung measures the load generator, not the target,
   and the ladder says so instead of calling the rung lost.

The mock engine and the load generator are raw asyncio protocols on uvloop (no HTTP library):
the engine writes pre-encoded chunked frames from a timer wheel (streams due in the same
QUANTUM share one timer), the client counts frames with bytes.count. The gateway runs with its
default limits (the generated config sets no pool size and no connection caps): the ladder
shows where a default stops a host.

Run only this lane:  python -m benchmarks.overhead --paced [--quick]
Latency only (no ladder), short responses:  ... --paced --paced-latency-only --paced-frames 4
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import resource
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

from benchmarks import overhead as ov

FRAMES, PACE_MS, FIRST_MS = 64, 20.0, 20.0
LADDER = (64, 256, 512, 1024, 2048, 4096)
QUICK_LADDER = (64, 256)
LAG_LIMIT_MS = PACE_MS / 2  # load-generator lag p99 over this: the rung measures the client
PATHS = ("direct", "nginx", "gateway")
LABELS = {"direct": "direct", "nginx": "nginx", "gateway": "slogate"}
MARK = b'"content":"t'  # a content frame (the role frame's content is empty)
END = b"\r\n0\r\n\r\n"  # the chunked body's last chunk
GAP_BIN_S = 1e-4  # gap histogram resolution (0.1 ms)
CLOCK = time.perf_counter  # the load generator's timestamps (uvloop's loop clock counts ms)


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def install_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop
        uvloop.install()


# ---------------------------------------------------------------------------------------------
# Mock engine: `python -m benchmarks.paced engine --port P`
# ---------------------------------------------------------------------------------------------

def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _frames() -> tuple[bytes, bytes, bytes, bytes]:
    """(response head, first frame, content frame, last frame + end) as the wire carries them."""
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    start = (b'data: {"id":"chatcmpl-paced","object":"chat.completion.chunk","created":0,'
             b'"model":"sim","choices":[{"index":0,"delta":{')
    close = b',"logprobs":null,"finish_reason":null}]}\n\n'
    role = start + b'"role":"assistant","content":""}' + close
    content = start + b'"content":"tok "}' + close
    finish = (start[:-len(b'"delta":{')] + b'"delta":{},"logprobs":null,'
              b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    return head, _chunk(role + content), _chunk(content), _chunk(content + finish) + b"0\r\n\r\n"


class _Wheel:
    """Streams due within the same quantum share one loop timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, quantum: float) -> None:
        self.loop, self.q = loop, quantum
        self.slots: dict[int, list[_EngineConn]] = {}

    def at(self, due: float, conn: _EngineConn) -> None:
        key = math.ceil(due / self.q)
        slot = self.slots.get(key)
        if slot is None:
            self.slots[key] = [conn]
            self.loop.call_at(key * self.q, self.fire, key)
        else:
            slot.append(conn)

    def fire(self, key: int) -> None:
        for conn in self.slots.pop(key, ()):
            conn.tick()


class _EngineConn(asyncio.Protocol):
    def __init__(self, eng: _Engine) -> None:
        self.eng = eng
        self.buf = b""
        self.t: asyncio.Transport | None = None
        self.left = 0  # frames still to send in the current response
        self.due = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.t = None

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while not self.left:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end].lower()
            n = 0
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                n = int(head[i + 17:j if j > 0 else len(head)])
            if len(buf) < end + 4 + n:
                break
            buf = buf[end + 4 + n:]
            self.request(head)
        self.buf = buf

    def request(self, head: bytes) -> None:
        assert self.t is not None
        if head.startswith(b"post ") and b"/chat/completions" in head[:64]:
            self.t.write(self.eng.head)
            self.left = self.eng.frames
            self.due = self.eng.loop.time() + self.eng.first
            self.eng.wheel.at(self.due, self)
            return
        body = b'{"object":"list","data":[{"id":"sim","object":"model"}]}'
        status = b"200 OK" if b" /v1/models" in head[:32] or b"/health" in head[:32] \
            else b"404 Not Found"
        self.t.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def tick(self) -> None:
        t = self.t
        if t is None or not self.left:
            return
        eng = self.eng
        left = self.left = self.left - 1
        if left == eng.frames - 1:
            t.write(eng.first_frame)
        elif left:
            t.write(eng.frame)
        else:
            t.write(eng.last_frame)
        if left:
            self.due += eng.pace
            eng.wheel.at(self.due, self)
        elif self.buf:  # a request that came in while this one streamed
            self.data_received(b"")


class _Engine:
    def __init__(self, frames: int, pace_ms: float, first_ms: float, quantum_ms: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.frames, self.pace, self.first = frames, pace_ms / 1e3, first_ms / 1e3
        self.wheel = _Wheel(self.loop, max(1e-6, quantum_ms / 1e3))
        self.head, self.first_frame, self.frame, self.last_frame = _frames()


async def _engine_serve(a: argparse.Namespace) -> None:
    eng = _Engine(a.frames, a.pace_ms, a.first_ms, a.quantum_ms)
    server = await eng.loop.create_server(lambda: _EngineConn(eng), a.host, a.port,
                                          backlog=4096)
    async with server:
        await server.serve_forever()


def engine_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.paced engine")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--frames", type=int, default=FRAMES)
    ap.add_argument("--pace-ms", type=float, default=PACE_MS)
    ap.add_argument("--first-ms", type=float, default=FIRST_MS)
    ap.add_argument("--quantum-ms", type=float, default=0.25,
                    help="streams due within this share one timer (default %(default)s)")
    a = ap.parse_args(argv)
    raise_nofile()
    install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_engine_serve(a))
    return 0


# ---------------------------------------------------------------------------------------------
# Load generator: `python -m benchmarks.paced --client-spec SPEC --client-out OUT`
# ---------------------------------------------------------------------------------------------

class _Run:
    """One load-generator process: `streams` connections, each sending one request after
    another. Count mode (`requests`): until that many have been sent. Window mode: requests
    started in [w0, w1) are measured; the process ends once they have."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.loop = asyncio.get_running_loop()
        self.spec = spec
        host, port = spec["host"], spec["port"]
        self.addr = (host, port)
        body = json.dumps({"model": "sim", "stream": True, "max_tokens": spec["frames"],
                           "messages": [{"role": "user", "content": "Tell me a story."}]}).encode()
        self.req = (f"POST {spec['path']} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    "Content-Type: application/json\r\nAuthorization: Bearer bench\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        self.frames = spec["frames"]
        self.max_gap = 2 * spec["pace_ms"] / 1e3
        self.max_ttft = (spec["first_ms"] + 2 * spec["pace_ms"]) / 1e3
        self.to_send: int | None = spec.get("requests")  # count mode
        self.w0 = self.w1 = 0.0
        self.sent = 0
        self.measured = 0
        self.passed = 0
        self.fails: Counter[str] = Counter()
        self.ttfts: list[float] = []
        self.gaps: Counter[int] = Counter()
        self.max_gap_seen = 0.0
        self.coalesced = 0
        self.frames_seen = 0
        self.open = 0
        self.stopping = False
        self.done = asyncio.Event()
        self.in_flight = 0

    def measuring(self, t: float) -> bool:
        return self.to_send is not None or self.w0 <= t < self.w1

    def want_more(self) -> bool:
        if self.stopping:
            return False
        if self.to_send is not None:
            return self.sent < self.to_send
        return CLOCK() < self.w1

    def finished(self, measured: bool, fail: str | None, ttft: float | None) -> None:
        self.in_flight -= 1
        if fail is not None:  # in the window or not: the rung's load failed a stream
            self.fails[fail] += 1
        if measured:
            self.measured += 1
            if fail is None:
                self.passed += 1
            if ttft is not None:
                self.ttfts.append(ttft)
        if self.in_flight == 0 and not self.want_more():
            self.done.set()


class _ClientConn(asyncio.Protocol):
    def __init__(self, run: _Run) -> None:
        self.run = run
        self.t: asyncio.Transport | None = None
        self.active = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.run.open += 1
        self.send()

    def send(self) -> None:
        run = self.run
        if self.t is None or not run.want_more():
            if self.t is not None:
                self.t.close()
            return
        run.sent += 1
        run.in_flight += 1
        self.active = True
        self.t_send = now = CLOCK()
        self.measured = run.measuring(now)
        self.head = b""
        self.in_body = False
        self.tail = b""
        self.n = 0
        self.last = 0.0
        self.ttft: float | None = None
        self.fail: str | None = None
        self.t.write(run.req)

    def data_received(self, data: bytes) -> None:
        if not self.active:
            return
        if not self.in_body:
            head = self.head + data
            end = head.find(b"\r\n\r\n")
            if end < 0:
                self.head = head
                return
            status = head[9:12]
            if status != b"200":
                self.end(f"http_{status.decode(errors='replace')}", close=True)
                return
            if b"chunked" not in head[:end].lower():
                self.end("not_chunked", close=True)
                return
            self.in_body = True
            data = head[end + 2:]  # keep "\r\n" so that END matches a first empty chunk too
        now = CLOCK()
        s = self.tail + data
        k = s.count(MARK)
        if k:
            run = self.run
            if self.n == 0:
                self.ttft = now - self.t_send
                if self.ttft > run.max_ttft and self.fail is None:
                    self.fail = "slow_first_frame"
            else:
                gap = now - self.last
                if self.measured:
                    run.gaps[int(gap / GAP_BIN_S)] += 1
                    if gap > run.max_gap_seen:
                        run.max_gap_seen = gap
                if gap > run.max_gap and self.fail is None:
                    self.fail = "gap_over_2x_pace"
            if self.measured:
                run.frames_seen += k
                if k > 1:
                    run.coalesced += k - 1
            self.n += k
            self.last = now
        if END in s:
            if self.n != self.run.frames and self.fail is None:
                self.fail = "short"
            self.end(self.fail)
            return
        self.tail = s[-(len(MARK) - 1):]  # a mark split across reads, never one counted

    def end(self, fail: str | None, close: bool = False) -> None:
        self.active = False
        self.run.finished(self.measured, fail, self.ttft if fail is None or self.n else None)
        if close and self.t is not None:
            self.t.close()
            self.t = None
            return
        self.run.loop.call_soon(self.send)

    def connection_lost(self, exc: Exception | None) -> None:
        self.run.open -= 1
        self.t = None
        if self.active:
            self.end("connection_lost")


async def _lag_probe(run: _Run, lags: list[float], period: float = 0.005) -> None:
    while not run.done.is_set():
        t = CLOCK()
        await asyncio.sleep(period)
        late = CLOCK() - t - period
        if run.measuring(t):
            lags.append(max(0.0, late))


async def _client_run(spec: dict[str, Any]) -> dict[str, Any]:
    run = _Run(spec)
    loop = run.loop
    watch: dict[str, int] = spec.get("watch", {})
    # Wall clock → loop clock: the load generators of one rung share one window.
    start = CLOCK() + max(0.0, spec["start_at"] - time.time())
    n = spec["streams"]
    ramp = spec.get("ramp", 0.0)
    if run.to_send is None:
        run.w0 = start + ramp + spec["settle"]
        run.w1 = run.w0 + spec["duration"]
    lags: list[float] = []
    probe = asyncio.create_task(_lag_probe(run, lags))
    errors: Counter[str] = Counter()

    async def connect(i: int) -> None:
        await asyncio.sleep(max(0.0, start + ramp * i / n - CLOCK()))
        try:
            await loop.create_connection(lambda: _ClientConn(run), *run.addr)
        except OSError as e:
            errors[type(e).__name__] += 1

    def sample() -> dict[str, Any]:
        return {"t": CLOCK(), **{name: (ov.proc_cpu_s(pid), ov.proc_sched_ns(pid))
                                     for name, pid in {**watch, "client": os.getpid()}.items()}}

    connects = [asyncio.create_task(connect(i)) for i in range(n)]
    await asyncio.sleep(max(0.0, run.w0 - CLOCK()))
    s0 = sample()
    rss: dict[str, int | None] = {}
    if run.to_send is None:
        await asyncio.sleep(max(0.0, run.w1 - CLOCK()))
        rss = {name: ov.proc_rss_kib(pid) for name, pid in watch.items()}
    await asyncio.gather(*connects)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(run.done.wait(), spec["grace"] + (
            0 if run.to_send is None else spec["requests"] * 2.0))
    s1 = sample()
    if not rss:
        rss = {name: ov.proc_rss_kib(pid) for name, pid in watch.items()}
    run.stopping = True
    run.done.set()
    probe.cancel()
    span = s1["t"] - s0["t"]
    cpu: dict[str, Any] = {}
    for name in (*watch, "client"):
        (a, a_ns), (b, b_ns) = s0[name], s1[name]
        cpu[name] = {
            "cpu_s": None if a is None or b is None else (b[0] + b[1]) - (a[0] + a[1]),
            "runq_wait_s": None if a_ns is None or b_ns is None else (b_ns[1] - a_ns[1]) / 1e9}
    unfinished = run.in_flight
    return {"span_s": span, "streams": n, "connected": n - sum(errors.values()),
            "measured": run.measured + unfinished, "passed": run.passed,
            "fails": dict(run.fails + Counter({"unfinished": unfinished} if unfinished else {})
                          + errors),
            "ttfts": run.ttfts, "gaps": {str(k): v for k, v in run.gaps.items()},
            "max_gap_ms": run.max_gap_seen * 1e3, "coalesced_frames": run.coalesced,
            "frames": run.frames_seen,
            "lag_ms": ov.percentiles(lags, (50, 99)), "cpu": cpu, "rss_kib": rss}


def client_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    raise_nofile()
    install_uvloop()
    result = asyncio.run(_client_run(spec))
    Path(out_path).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------
# Merging the load generators' results
# ---------------------------------------------------------------------------------------------

def hist_percentiles(hist: Counter[int], pcts: tuple[float, ...] = (50, 99)) -> dict[str, Any]:
    n = sum(hist.values())
    out: dict[str, Any] = {"n": n}
    keys = sorted(hist)
    for p in pcts:
        if not n:
            out[f"p{p:g}"] = None
            continue
        rank, seen = p / 100 * (n - 1), 0
        for k in keys:
            seen += hist[k]
            if seen > rank:
                out[f"p{p:g}"] = (k + 0.5) * GAP_BIN_S * 1e3
                break
    return out


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    span = max(p["span_s"] for p in parts) or 1.0
    gaps: Counter[int] = Counter()
    fails: Counter[str] = Counter()
    ttfts: list[float] = []
    for p in parts:
        gaps.update({int(k): v for k, v in p["gaps"].items()})
        fails.update(p["fails"])
        ttfts += p["ttfts"]
    cpu: dict[str, Any] = {}
    for name in parts[0]["cpu"]:
        if name == "client":
            continue
        c = parts[0]["cpu"][name]
        cpu[name] = {"util": None if c["cpu_s"] is None else c["cpu_s"] / span,
                     "runq_wait_frac": None if c["runq_wait_s"] is None
                     else c["runq_wait_s"] / span, "cpu_s": c["cpu_s"]}
    client_cpu = [p["cpu"]["client"]["cpu_s"] for p in parts]
    cpu["client"] = {"util": sum(c or 0 for c in client_cpu) / span, "processes": len(parts),
                     "runq_wait_frac": sum(p["cpu"]["client"]["runq_wait_s"] or 0
                                           for p in parts) / span}
    measured = sum(p["measured"] for p in parts)
    passed = sum(p["passed"] for p in parts)
    lag99 = [p["lag_ms"]["p99"] for p in parts if p["lag_ms"]["p99"] is not None]
    lagmax = [p["lag_ms"]["max"] for p in parts if p["lag_ms"]["max"] is not None]
    return {
        "span_s": span, "streams": sum(p["streams"] for p in parts),
        "connected": sum(p["connected"] for p in parts),
        "requests": measured, "passed": passed, "fails": dict(fails),
        "held": measured > 0 and passed == measured and not fails,
        "ttft_ms": ov.percentiles(ttfts, (50, 99)), "gap_ms": hist_percentiles(gaps),
        "max_gap_ms": max(p["max_gap_ms"] for p in parts),
        "coalesced_frames": sum(p["coalesced_frames"] for p in parts),
        "frames_per_s": sum(p["frames"] for p in parts) / span,
        "client_lag_ms": {"p99": max(lag99) if lag99 else None,
                          "max": max(lagmax) if lagmax else None},
        "cpu": cpu, "rss_kib": parts[0]["rss_kib"],
    }


# ---------------------------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("paced-stream lane")
    g.add_argument("--paced", action="store_true", help="run only the paced-stream lane")
    g.add_argument("--no-paced", action="store_true", help="skip the paced-stream lane")
    g.add_argument("--paced-ladder", help="concurrent paced streams per rung "
                   "(default 64,256,512,1024,2048,4096; quick: 64,256)")
    g.add_argument("--paced-latency-only", action="store_true",
                   help="measure latency at c=1 and c=8 only (no ladder)")
    g.add_argument("--paced-frames", type=int,
                   help=f"content frames per response (default {FRAMES}; fewer: a shorter "
                   "request, for TTFT)")
    g.add_argument("--paced-requests", type=int,
                   help="requests at c=1 and at c=8 per target (default 300; quick: 24)")
    g.add_argument("--paced-window", type=float,
                   help="seconds measured per rung (default 8; quick: 3)")
    g.add_argument("--paced-clients", type=int, default=1,
                   help="load-generator processes per rung (default 1)")
    g.add_argument("--paced-targets", default=",".join(PATHS),
                   help="targets, in order (default %(default)s)")
    g.add_argument("--paced-out", default="bench-results/paced.json")
    g.add_argument("--paced-markdown", default="bench-results/paced.md")


def run_lane(args: argparse.Namespace, placement: dict[str, set[int] | None]) -> int:
    ov.NICE = args.nice  # `python -m benchmarks.overhead` is __main__, not this `ov`
    quick = args.quick
    ladder = ([int(s) for s in args.paced_ladder.split(",")] if args.paced_ladder
              else list(QUICK_LADDER if quick else LADDER))
    if args.paced_latency_only:
        ladder = []
    frames = args.paced_frames or FRAMES
    requests = args.paced_requests or (24 if quick else 300)
    window = args.paced_window or (3.0 if quick else 8.0)
    targets = [t.strip() for t in args.paced_targets.split(",") if t.strip()]
    if "nginx" in targets and not (shutil.which("nginx") or Path("/usr/sbin/nginx").exists()):
        print("note: nginx not installed (make system-deps): the lane runs without it",
              file=sys.stderr)
        targets.remove("nginx")
    tmp = Path(tempfile.mkdtemp(prefix="slogate-paced-"))
    procs = ov.Procs(tmp)
    host = args.host
    gw_cpus, eng_cpus, client_cpus = placement["gateway"], placement["sim"], placement["client"]
    ports = {"direct": ov.free_port(host), "nginx": ov.free_port(host),
             "gateway": ov.free_port(host)}
    results: dict[str, Any] = {"meta": {
        "benchmark": "paced", "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git": ov.git_rev(), "frames": frames, "pace_ms": PACE_MS, "first_ms": FIRST_MS,
        "requests": requests, "window_s": window, "ladder": ladder, "targets": targets,
        "clients": args.paced_clients,
        "placement": {k: ov.fmt_cpus(v) for k, v in placement.items()},
        "host": {"cpus": os.cpu_count(), "cpu_model": ov.cpu_model(),
                 "loadavg_start": " ".join(Path("/proc/loadavg").read_text().split()[:3])},
    }, "latency": [], "ladder": {}}
    ok = False
    try:
        eng = procs.start("engine", [sys.executable, "-m", "benchmarks.paced", "engine",
                                     "--host", host, "--port", str(ports["direct"]),
                                     "--frames", str(frames)], eng_cpus)
        ov.wait_http(procs, "engine", f"http://{host}:{ports['direct']}/v1/models")
        pids: dict[str, int] = {}
        if "nginx" in targets:
            _, pids["nginx"] = ov.start_nginx(procs, tmp, host, ports["nginx"], ports["direct"],
                                              gw_cpus, max(ladder, default=64))
        if "gateway" in targets:
            cfg = tmp / "gateway.toml"
            cfg.write_text(ov.gateway_config(host, ports["gateway"], ports["direct"], None, ""))
            argv = shlex.split(args.gateway_cmd.format(
                python=shlex.quote(sys.executable), config=cfg, host=host,
                port=ports["gateway"]))
            gw = procs.start("gateway", argv, gw_cpus)
            ov.wait_http(procs, "gateway", f"http://{host}:{ports['gateway']}/healthz")
            pids["gateway"] = gw.pid
        print(f"paced lane: {frames} frames × {PACE_MS:g} ms after {FIRST_MS:g} ms; targets "
              f"{', '.join(targets)}; logs in {tmp}", flush=True)

        def point(target: str, streams: int, **mode: Any) -> dict[str, Any]:
            watch = {"engine": eng.pid}
            if pids.get(target):
                watch["target"] = pids[target]
            nproc = max(1, min(args.paced_clients, streams))
            start_at = time.time() + 0.5
            specs = []
            for i in range(nproc):
                share = streams // nproc + (1 if i < streams % nproc else 0)
                spec = {"host": host, "port": ports[target], "path": "/v1/chat/completions",
                        "frames": frames, "pace_ms": PACE_MS, "first_ms": FIRST_MS,
                        "streams": share, "start_at": start_at, "watch": watch,
                        "grace": FIRST_MS / 1e3 + frames * PACE_MS / 1e3 + 3.0, **mode}
                if "requests" in mode:
                    spec["requests"] = mode["requests"] // nproc + (
                        1 if i < mode["requests"] % nproc else 0)
                specs.append(spec)
            limit = 60 + (mode.get("requests", 0) * 2.0 / max(1, streams)
                          + mode.get("ramp", 0) + mode.get("settle", 0)
                          + mode.get("duration", 0))
            parts = run_parallel(procs, tmp, f"{target}-{streams}", specs, client_cpus, limit)
            return merge(parts)

        for c in (1, 8):
            row: dict[str, Any] = {"streams": c}
            for target in targets:
                print(f"[c={c}] {target:<8} {requests} requests …", end=" ", flush=True)
                r = point(target, c, requests=requests, ramp=PACE_MS / 1e3 * frames,
                          settle=0.0)
                row[target] = r
                print(_line(r), flush=True)
            results["latency"].append(row)
        for target in targets:
            rungs: list[dict[str, Any]] = []
            for n in ladder:
                print(f"[{n:>5} paced streams] {target:<8} …", end=" ", flush=True)
                ramp = max(FIRST_MS / 1e3 + frames * PACE_MS / 1e3, n / 1500)
                for attempt in (1, 2):  # a lost rung is run again once: one stall of a
                    #                     shared machine is not the target's limit
                    r = point(target, n, ramp=ramp, settle=1.0, duration=window)
                    r["client_limited"] = (r["client_lag_ms"]["p99"] or 0) > LAG_LIMIT_MS
                    r["attempt"] = attempt
                    print(_line(r) + ("  (load generator lagging)" if r["client_limited"]
                                      else ""), flush=True)
                    procs.check_alive()
                    if r["held"] or attempt == 2:
                        break
                    print(f"[{n:>5} paced streams] {target:<8} again …", end=" ", flush=True)
                    time.sleep(1.0)
                rungs.append(r)
                if not r["held"] or r["client_limited"]:
                    break
                time.sleep(1.0)
            results["ladder"][target] = rungs
        ok = True
    except RuntimeError as e:
        print(f"\npaced lane failed: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        if ok and not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"process logs in {tmp}", file=sys.stderr)
    results["meta"]["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    for r in _walk(results):
        r.pop("ttfts", None)
    out = Path(args.paced_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    table = render(results)
    print("\n" + table + f"\n\nresults: {out}")
    if args.paced_markdown:
        Path(args.paced_markdown).write_text(table + "\n")
    return 0


def _walk(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [r for row in results["latency"] for k, r in row.items() if k != "streams"]
    return rows + [r for rungs in results["ladder"].values() for r in rungs]


def run_parallel(procs: ov.Procs, tmp: Path, tag: str, specs: list[dict[str, Any]],
                 cpus: set[int] | None, limit_s: float) -> list[dict[str, Any]]:
    """Several load generators at once (ov.run_json_process runs one to its end)."""
    if len(specs) == 1:
        return [ov.run_json_process(procs, tmp, tag, "benchmarks.paced", specs[0], cpus,
                                    limit_s)]
    started = []
    for i, spec in enumerate(specs):
        sp, op = tmp / f"spec-{tag}-{i}.json", tmp / f"out-{tag}-{i}.json"
        sp.write_text(json.dumps(spec))
        with contextlib.suppress(FileNotFoundError):
            op.unlink()
        p = procs.start(f"client-{tag}-{i}", [sys.executable, "-m", "benchmarks.paced",
                                              "--client-spec", str(sp), "--client-out",
                                              str(op)], cpus)
        started.append((p, op))
    deadline = time.monotonic() + limit_s
    try:
        while any(p.poll() is None for p, _ in started):
            procs.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"load generators {tag} did not finish in {limit_s:.0f}s")
            time.sleep(0.1)
        return [ov.load_json_object(op) for _, op in started]
    finally:
        for p, _ in started:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _line(r: dict[str, Any]) -> str:
    c = r["cpu"].get("target", {})
    fails = f", fails {r['fails']}" if r["fails"] else ""
    return (f"{r['passed']}/{r['requests']} held, TTFT p50/p99 {ov.fmt(r['ttft_ms']['p50'])}/"
            f"{ov.fmt(r['ttft_ms']['p99'])} ms, gap p99 {ov.fmt(r['gap_ms']['p99'])} ms "
            f"(max {r['max_gap_ms']:.1f}), CPU {ov.fmt((c.get('util') or 0) * 100, '.0f')}%, "
            f"client lag p99 {ov.fmt(r['client_lag_ms']['p99'])} ms{fails}")


def render(results: dict[str, Any]) -> str:
    m = results["meta"]
    targets = m["targets"]
    lines = [
        f"### Paced streams — {m['frames']} frames × {m['pace_ms']:g} ms after "
        f"{m['first_ms']:g} ms; direct, nginx (proxy_buffering off) and slogate in one run",
        "",
        f"Placement: proxies {m['placement']['gateway']}; mock engine {m['placement']['sim']}; "
        f"load generator {m['placement']['client']} ({m['clients']} process(es)). Host: "
        f"{m['host']['cpus']} CPUs ({m['host']['cpu_model']}), load avg at start "
        f"{m['host']['loadavg_start']}. Git: {m['git']}.",
        "",
        f"**Latency** ({m['requests']} requests per target and concurrency, closed loop):",
        "",
        "| c | target | TTFT p50 | TTFT p99 | gap p50 | gap p99 | +TTFT p50 | +TTFT p99 "
        "| +gap p50 | +gap p99 | CPU % | held |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["latency"]:
        d = row.get("direct")
        for t in targets:
            r = row[t]

            def add(kind: str, p: str, r: dict[str, Any] = r, t: str = t,
                    d: dict[str, Any] | None = d) -> str:
                if t == "direct" or d is None:
                    return ""
                return ov.fmt(ov._diff(r[kind][p], d[kind][p]))
            lines.append(
                f"| {row['streams']} | {LABELS[t]} | {ov.fmt(r['ttft_ms']['p50'])} "
                f"| {ov.fmt(r['ttft_ms']['p99'])} | {ov.fmt(r['gap_ms']['p50'])} "
                f"| {ov.fmt(r['gap_ms']['p99'])} | {add('ttft_ms', 'p50')} "
                f"| {add('ttft_ms', 'p99')} | {add('gap_ms', 'p50')} | {add('gap_ms', 'p99')} "
                f"| {_pc(r, 'target' if t != 'direct' else 'engine')} "
                f"| {r['passed']}/{r['requests']} |")
    lines += [
        "",
        "**Sustained paced streams** (a rung is held when every request of it got all "
        f"{m['frames']} frames, the first within {m['first_ms'] + 2 * m['pace_ms']:g} ms and no "
        f"gap over {2 * m['pace_ms']:g} ms; figures from the requests started in its "
        f"{m['window_s']:g} s window; a lost rung is run once more):",
        "",
        "| target | streams | held | requests | TTFT p99 | gap p99 | max gap | frames/s "
        "| CPU % of its core [wait] | RSS MiB | engine CPU % | client CPU % | client lag p99 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = []
    for t, rungs in results["ladder"].items():
        best = None
        for r in rungs:
            rss = r["rss_kib"].get("target") or r["rss_kib"].get("engine")
            verdict = ("yes" if r["held"] else "no") + (" (client-limited)"
                                                         if r.get("client_limited") else "")
            lines.append(
                f"| {LABELS[t]} | {r['streams']} | {verdict} | {r['passed']}/{r['requests']} "
                f"| {ov.fmt(r['ttft_ms']['p99'])} | {ov.fmt(r['gap_ms']['p99'])} "
                f"| {r['max_gap_ms']:.1f} | {r['frames_per_s']:.0f} "
                f"| {_pc(r, 'target') if t != 'direct' else '–'} "
                f"| {ov.fmt((rss or 0) / 1024, '.1f') if t != 'direct' else '–'} "
                f"| {_pc(r, 'engine')} | {_pc(r, 'client')} "
                f"| {ov.fmt(r['client_lag_ms']['p99'])} |")
            if r["held"] and not r.get("client_limited"):
                best = r["streams"]
        last = rungs[-1] if rungs else None
        why = ("the ladder's top" if last and last["held"] and not last.get("client_limited")
               else "then the load generator lagged" if last and last.get("client_limited")
               else f"then {last['fails']}" if last else "")
        summary.append(f"{LABELS[t]} {best if best is not None else 'none'} ({why})")
    lines += ["", "Highest rung held: " + "; ".join(summary) + ".", "",
              "Times in ms at the client. +X = target percentile − direct percentile. CPU % = of "
              "one core over the window (utime+stime from /proc/PID/stat), in brackets its "
              "run-queue wait (other work on that core). Client lag = how late the load "
              f"generator's 5 ms timer fired (over {m['pace_ms'] / 2:g} ms p99: the rung "
              "measures the load generator)."]
    return "\n".join(lines)


def _pc(r: dict[str, Any], name: str) -> str:
    return ov._pc(r["cpu"], name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["engine"]:
        return engine_main(argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--client-spec", required=True)
    ap.add_argument("--client-out", required=True)
    a = ap.parse_args(argv)
    return client_main(a.client_spec, a.client_out)


if __name__ == "__main__":
    sys.exit(main())
