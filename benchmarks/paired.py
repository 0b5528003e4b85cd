"""This checkout's gateway and another revision's, on the same core at the same time, each with
its own load generator: the cleanest A/B of CPU per token on a machine shared with other work
(both see the same contention, the same saturation, the same moment).

    python -m benchmarks.paired [--streams 32] [--reps 3] [--duration 8] [--baseline main]
                                [--tokens 100] [--candidate-tree DIR]

Each gateway gets `--streams` closed-loop streams (`--tokens`-token answers, default 100, at 2 ms
per token from one simulator); the gateways share the second CPU, the simulator and both load
generators the first. `--candidate-tree DIR` runs the gateway of a prepared tree (e.g. one with
extension modules built in place) in place of this checkout's. Prints CPU µs per streamed
token and per request of each, per repetition and the medians (short answers, e.g.
`--tokens 2`, weigh the per-request work).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import overhead as ov


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32, help="streams per gateway (default 32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--baseline", default="main", help="git revision to compare with")
    ap.add_argument("--tokens", type=int, default=100, help="tokens per answer (default 100)")
    ap.add_argument("--baseline-python", help="the baseline gateway's Python (another venv: "
                    "compares dependency versions; default: this one)")
    ap.add_argument("--candidate-tree", type=Path, help="run the gateway from this source tree "
                    "(as it is, built extension modules included) instead of this checkout")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="slogate-paired-"))
    procs = ov.Procs(tmp)
    host, py = "127.0.0.1", sys.executable
    sim_port = ov.free_port(host)
    allowed = sorted(os.sched_getaffinity(0))
    load_cpu, gw_cpu = ({allowed[0]}, {allowed[1]}) if len(allowed) > 1 else (None, None)
    try:
        procs.start("sim", shlex.split(ov.DEFAULT_SIM_CMD.format(
            python=py, host=host, port=sim_port, token_ms="2", max_batch="2048")), load_cpu)
        ov.wait_http(procs, "sim", f"http://{host}:{sim_port}/v1/models")
        base = tmp / "baseline"
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline], cwd=ov.REPO,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        pids, urls = {}, {}
        candidate = args.candidate_tree.resolve() if args.candidate_tree else None
        for name, cwd in (("gateway", candidate or ov.REPO), ("baseline", base)):
            port = ov.free_port(host)
            cfg = tmp / f"{name}.toml"
            cfg.write_text(ov.gateway_config(host, port, sim_port, 512, ""))
            env = dict(os.environ)
            if name == "baseline" or candidate:
                env["PYTHONPATH"] = str(cwd)
            gw_py = args.baseline_python if name == "baseline" and args.baseline_python else py
            p = procs.start(name, shlex.split(ov.DEFAULT_GATEWAY_CMD.format(
                python=gw_py, config=cfg, host=host, port=port)), gw_cpu, env=env, cwd=cwd)
            ov.wait_http(procs, name, f"http://{host}:{port}/healthz")
            pids[name], urls[name] = p.pid, f"http://{host}:{port}/v1/chat/completions"
        res: dict[str, list[float]] = {"gateway": [], "baseline": []}
        per_req: dict[str, list[float]] = {"gateway": [], "baseline": []}
        for rep in range(args.reps):
            running = {}
            for name in res:
                spec = {"path": f"{name}-{rep}", "url": urls[name], "streams": args.streams,
                        "warmup": 2.0, "duration": args.duration, "tokens": args.tokens,
                        "token_ms": 2.0, "grace": 10.0, "watch": {"gateway": pids[name]}}
                sp, op = tmp / f"spec-{name}-{rep}.json", tmp / f"out-{name}-{rep}.json"
                sp.write_text(json.dumps(spec))
                running[name] = (procs.start(f"client-{name}-{rep}", [
                    py, "-m", "benchmarks.overhead", "--client-spec", str(sp),
                    "--client-out", str(op)], load_cpu), op)
            for name, (p, op) in running.items():
                p.wait()
                r = json.loads(op.read_text())
                g = r["cpu"]["gateway"]
                us = g["cpu_s"] / r["tokens"] * 1e6
                us_req = g["cpu_s"] / r["requests"] * 1e6
                res[name].append(us)
                per_req[name].append(us_req)
                print(f"rep {rep + 1} {name:8s} {r['tokens_per_s']:7.0f} tok/s  {us:5.1f} µs/token"
                      f"  {us_req:6.0f} µs/request"
                      f"  CPU {g['util'] * 100:3.0f}%  run-queue wait "
                      f"{g['runq_wait_frac'] * 100:3.0f}%  TTFT p50 {r['ttft_ms']['p50']:.2f} ms",
                      flush=True)
        diff = [a - b for a, b in zip(per_req["gateway"], per_req["baseline"], strict=True)]
        for name, v in res.items():
            label = (str(candidate or "this checkout") if name == "gateway"
                     else args.baseline)
            print(f"{label}: median {statistics.median(v):.1f} µs/token "
                  f"({', '.join(f'{x:.1f}' for x in v)}), "
                  f"{statistics.median(per_req[name]):.0f} µs/request "
                  f"({', '.join(f'{x:.0f}' for x in per_req[name])})")
        print(f"difference (this checkout - {args.baseline}, same rep): median "
              f"{statistics.median(diff):+.0f} µs/request ({', '.join(f'{x:+.0f}' for x in diff)})")
    finally:
        procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
