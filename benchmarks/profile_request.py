"""Where one request's CPU goes, stage by stage: the gateway (pinned to one core, default
telemetry) against the simulator with short streamed answers, first measured plain (CPU per
request from /proc), then under cProfile; each stage's share of the profiled time is scaled to
the plain CPU per request.

    python -m benchmarks.profile_request [--streams 16] [--duration 6] [--tokens 2]
                                         [--top 25] [--stats FILE]

A stage is the inclusive time of the functions that do it (cProfile's cumulative time; a
coroutine's counts every resume, never its waits). What no stage claims — aiohttp's server
protocol and handler task, the client's response parsing, the event loop's callbacks — is the
"server, client and loop" line, and the busiest functions by own time are listed after the
table. cProfile inflates small functions more than large ones: read the shares, not the
absolute profiled microseconds. Uses only the standard library's profiler.
"""
from __future__ import annotations

import argparse
import json
import os
import pstats
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import overhead as ov

# (stage, [(file suffix, function name), ...]): inclusive time of each, summed (none nest).
STAGES: list[tuple[str, list[tuple[str, str]]]] = [
    ("exchange (the record, request id)", [("gateway/exchange.py", "__init__")]),
    ("authenticate", [("request/proxy.py", "authenticate")]),
    ("classify (SLO class, overrides)", [("request/proxy.py", "classify")]),
    ("read (body, model, stream)", [("request/proxy.py", "read")]),
    ("deadlines + span start", [("request/proxy.py", "start_deadlines")]),
    ("admit", [("request/proxy.py", "admit")]),
    ("choose replica", [("request/proxy.py", "choose_replica")]),
    ("upstream request: build", [("request/proxy.py", "send_upstream")]),
    ("relay: set-up (headers out, hook)", [("request/proxy.py", "relay")]),
    ("relay: upstream reads (parse, stamp, write)", [("request/relay.py", "body_data")]),
    ("relay: the coroutine (wait, end)", [("request/relay.py", "run")]),
    ("finish: release (ticket, pool)", [("request/proxy.py", "finish")]),
    ("finish: verdict + TTFT split", [("request/slo.py", "verdict"),
                                      ("telemetry/attribution.py", "ttft_split")]),
    ("finish: Prometheus metrics", [("telemetry/prometheus.py", "observe")]),
    ("finish: tenant metrics", [("telemetry/tenants.py", "observe")]),
    ("finish: spans", [("telemetry/tracing.py", "finish")]),
    ("finish: console", [("console/recorder.py", "record")]),
    ("finish: access log", [("telemetry/access_log.py", "write")]),
    ("response end (aiohttp write_eof)", [("aiohttp/web_response.py", "write_eof")]),
]
# Parts of a stage done by another stage's function: (stage, part's stage, subtracted), each
# subtracted function with the caller it is counted under when it has others too.
NESTED: list[tuple[str, str, list[tuple[str, ...]]]] = [
    ("upstream request: build", "upstream send (write, wait for headers)",
     [("transport/client.py", "send")]),
    ("relay: set-up (headers out, hook)", "", [("request/relay.py", "run")]),
    ("relay: upstream reads (parse, stamp, write)", "relay: first token → commit write",
     [("request/relay.py", "_commit")]),
    ("relay: the coroutine (wait, end)", "", [("aiohttp/web_response.py", "write_eof"),
                                               ("request/relay.py", "body_data",
                                                "transport/wire.py", "_buffered")]),
    ("finish: release (ticket, pool)", "", [("request/finish.py", "finish")]),
]
# The loop's own entry points: their time includes waiting for events (not CPU).
IDLE = ("run_until_complete", "run_forever", "select", "poll")
PER_REQUEST = ("request/proxy.py", "authenticate")  # called once per request


def serve_profiled(argv: list[str]) -> int:
    """The gateway, with SIGUSR1 starting the profiler and SIGUSR2 writing its stats to the
    file named by SLOGATE_PROFILE_OUT."""
    import cProfile

    from gateway.ops.cli import main

    prof = cProfile.Profile()
    out = os.environ["SLOGATE_PROFILE_OUT"]

    def start(*_: object) -> None:
        prof.enable()

    def dump(*_: object) -> None:
        prof.disable()
        prof.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    return main(argv)


def _matches(key: tuple[str, int, str], spec: tuple[str, str]) -> bool:
    return key[0].endswith(spec[0]) and key[2] == spec[1]


def _idle(key: tuple[str, int, str]) -> bool:
    """A builtin of the event loop whose time is its wait for events."""
    return key[0] == "~" and any(name in key[2] for name in IDLE)


def stage_table(stats_file: Path, cpu_us_per_request: float | None,
                top: int) -> tuple[list[tuple[str, float, float]], list[str], int]:
    """[(stage, profiled µs per request, scaled µs per request)], the busiest functions, and
    the requests counted."""
    st = pstats.Stats(str(stats_file))
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = st.stats  # type: ignore[attr-defined]
    requests = sum(v[1] for k, v in raw.items() if _matches(k, PER_REQUEST))
    if not requests:
        raise SystemExit("no request was profiled")

    def cum(specs: Sequence[tuple[str, ...]]) -> float:
        total = 0.0
        for s in specs:
            for k, v in raw.items():
                if _matches(k, (s[0], s[1])):
                    if len(s) == 2:
                        total += v[3]
                    else:  # only under that caller
                        total += sum(c[3] for ck, c in v[4].items()  # type: ignore[attr-defined]
                                     if _matches(ck, (s[2], s[3])))
        return total

    total = sum(v[2] for k, v in raw.items() if not _idle(k))
    stages = {name: cum(specs) for name, specs in STAGES}
    for outer, part, specs in NESTED:
        inner = cum(specs)
        stages[outer] -= inner
        if part:
            stages[part] = inner
    claimed = sum(stages.values())
    stages["server, client and loop (unclaimed)"] = total - claimed
    scale = cpu_us_per_request / (total / requests * 1e6) if cpu_us_per_request else None
    rows = [(name, t / requests * 1e6, t / requests * 1e6 * scale if scale else float("nan"))
            for name, t in stages.items()]
    rows.append(("total", total / requests * 1e6, cpu_us_per_request or float("nan")))
    busiest = sorted(((v[2], k) for k, v in raw.items() if not _idle(k)), reverse=True)
    lines = [f"{t / requests * 1e6:7.1f} µs  {Path(k[0]).name}:{k[1]} {k[2]}"
             for t, k in busiest[:top]]
    return rows, lines, requests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--stats", help="keep the cProfile stats in this file")
    ap.add_argument("--json", help="write the table as JSON here")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="slogate-profile-"))
    procs = ov.Procs(tmp)
    host, py = "127.0.0.1", sys.executable
    allowed = sorted(os.sched_getaffinity(0))
    load_cpu, gw_cpu = ({allowed[0]}, {allowed[1]}) if len(allowed) > 1 else (None, None)
    stats_file = Path(args.stats) if args.stats else tmp / "gateway.prof"
    try:
        sim_port = ov.free_port(host)
        procs.start("sim", shlex.split(ov.DEFAULT_SIM_CMD.format(
            python=py, host=host, port=sim_port, token_ms="2", max_batch="2048")), load_cpu)
        ov.wait_http(procs, "sim", f"http://{host}:{sim_port}/v1/models")
        port = ov.free_port(host)
        cfg = tmp / "gateway.toml"
        cfg.write_text(ov.gateway_config(host, port, sim_port, 512, ""))
        env = dict(os.environ, SLOGATE_PROFILE_OUT=str(stats_file),
                   PYTHONPATH=str(ov.REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        gw = procs.start("gateway", [py, "-m", "benchmarks.profile_request", "--serve",
                                     "serve", "--config", str(cfg), "--host", host,
                                     "--port", str(port)], gw_cpu, env=env)
        ov.wait_http(procs, "gateway", f"http://{host}:{port}/healthz")
        url = f"http://{host}:{port}/v1/chat/completions"

        def load(name: str) -> dict[str, Any]:
            spec = {"path": name, "url": url, "streams": args.streams, "warmup": 1.0,
                    "duration": args.duration, "tokens": args.tokens, "token_ms": 2.0,
                    "grace": 5.0, "watch": {"gateway": gw.pid}}
            return ov.run_client(procs, tmp, spec, load_cpu)

        plain = load("plain")
        cpu_us: float = plain["cpu"]["gateway"]["cpu_s"] / plain["requests"] * 1e6
        os.kill(gw.pid, signal.SIGUSR1)
        load("profiled")
        os.kill(gw.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not stats_file.exists() or stats_file.stat().st_size == 0:
            if time.monotonic() > deadline:
                raise SystemExit("the gateway wrote no profile")
            time.sleep(0.2)
        time.sleep(0.5)  # let the dump finish
        rows, busiest, n = stage_table(stats_file, cpu_us, args.top)
    finally:
        procs.stop_all()
    print(f"{n} requests profiled ({args.tokens}-token answers, {args.streams} streams); "
          f"plain CPU {cpu_us:.0f} µs/request")
    print(f"{'stage':42s} {'profiled µs':>12s} {'≈ µs (scaled)':>14s}")
    for name, prof_us, scaled in rows:
        print(f"{name:42s} {prof_us:12.1f} {scaled:14.1f}")
    print("\nbusiest functions (own time, profiled µs per request):")
    print("\n".join(busiest))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_us_per_request": cpu_us, "requests": n,
                                               "stages": rows}, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve_profiled(sys.argv[2:]))
    sys.exit(main())
