#!/usr/bin/env python3
"""Goodput benchmark: SLO-aware admission versus plain pass-through under overload.

The benchmark starts the engine simulator with a known capacity (max batch 16, decode step
10 ms + 1 ms per sequence, prefill 20k tokens/s, chunks of 2048) and two gateways in front of it:
one with `[admission] enabled = false` (plain pass-through) and one with it on. Both have the same
two SLO classes:

    interactive  TTFT 1000 ms, TPOT  50 ms, priority 10, 70 % of the traffic
    batch        TTFT 30 s,    TPOT 200 ms, priority 0,  30 %

Capacity (requests/s the engine sustains while meeting the interactive SLO) is *measured*: a
closed loop of exactly max-batch workers sends the benchmark's request mix straight to the
simulator, so the batch is always full and nothing queues; the completion rate is the engine's
service rate, and the interactive P99 TTFT/TPOT of that loop show that the SLO holds at that rate
(the printout says if it does not). The analytic value from the simulator's step model is printed
next to it: 1 / (E[out] * (decode_base / B + decode_per_seq) + E[prompt] / prefill_rate).

Then, for each load point (0.5, 1, 1.5, 2, 3 × capacity) and each gateway, one load-generator
process replays the same seeded open-loop Poisson schedule (the arrival count of the warm-up,
the window and the tail each fixed at rate × length, times uniform: a Poisson process conditioned
on its counts, so both modes see exactly the offered rate in the window): 80 % short prompts
(150-250 tokens), 20 % long ones (1500-2500), output lengths lognormal (median 100, sigma 0.5,
16-400 tokens, forced with x-sim-output-tokens), 70 % interactive / 30 % batch (the `x-slo-class`
header). Arrivals run for `--warmup` seconds (not
measured: the queues fill, the admission estimators learn online from the gateway's own traffic)
and then the measured `--window`; they go on after it only while retry probes are pending.

Measured at the client (raw aiohttp + uvloop, a byte check for non-empty delta.content), in the
window, i.e. as rates while the system is in its loaded state:
  goodput   requests that *finished* in the window having met both SLOs (HTTP 200, every
            requested token, TTFT <= class TTFT, TPOT <= class TPOT) / window seconds. Counting
            completions, not arrivals, keeps it a sustained rate: it cannot exceed what the engine
            serves, and an overloaded FIFO that is still working off its backlog when the window
            closes is not credited with work it has not done;
  TTFT      request sent -> first SSE event with non-empty delta.content (first tokens in the
            window);
  TPOT      (last content event - first) / (content events - 1), of requests finished in the
            window;
  rejected  429s received in the window / arrivals in the window;
  Retry-After accuracy: a seeded sample (`--probe-fraction`) of the requests rejected in the window
            is sent again, the same prompt and class, exactly Retry-After seconds after the 429, as
            a probe that asks for one output token (so the probes add prefill work but little
            decode work; the admission decision does not depend on the output length). Reported:
            the share of probes admitted (HTTP 200), and admitted with TTFT within the SLO. Probes
            never count towards goodput; arrivals go on until the last probe is answered (at most
            `--tail-cap` s), then everything still open is cancelled.

During each run the load generator polls GET /admin/admission and the simulator's /sim/stats
twice a second (queue depth by class, work ahead, engine running/waiting); the orchestrator scrapes
the gateway's /metrics before and after (admission decisions by class and reason, mean |predicted -
actual| TTFT) and keeps /admin/admission (estimator state) at the end of the window.

Placement (from benchmarks/overhead.py, whose process helpers this reuses): the gateways on the
second allowed CPU, the simulator and the load generator on the first.

Usage (from the repository root):
    .venv/bin/python -m benchmarks.goodput             # 5 points x 2 modes, 5 + 15 s each
                                                       # (~4-5 min)
    .venv/bin/python -m benchmarks.goodput --quick     # 1x and 2x, 3 + 6 s each (~1 min smoke)
    .venv/bin/python -m benchmarks.goodput --capacity 4.4 --loads 2 --window 20
Output: a markdown table on stdout (and --markdown, default bench-results/goodput.md), JSON
(--out, default bench-results/goodput.json), a PNG plot (--plot, default
bench-results/goodput.png; needs matplotlib, the `bench` extra).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(REPO))

from benchmarks import overhead as harness  # noqa: E402  (process management, placement)
from benchmarks.overhead import (  # noqa: E402
    Procs,
    cpu_model,
    fmt_cpus,
    free_port,
    gateway_config,
    git_rev,
    parse_cpus,
    run_json_process,
    wait_http,
)
from gateway.admission.reserve import fair_shares  # noqa: E402  (the gateway's own water-filling)
from gateway.telemetry.decisions import MAX_QUERY  # noqa: E402

DEFAULT_SIM_CMD = ("{python} -m gateway sim --host {host} --port {port} --max-batch {max_batch} "
                   "--decode-base-ms {decode_base_ms} --decode-per-seq-ms {decode_per_seq_ms} "
                   "--prefill-tokens-per-s {prefill_tokens_per_s} "
                   "--prefill-chunk-tokens {prefill_chunk_tokens}")
DEFAULT_GATEWAY_CMD = "{python} -m gateway serve --config {config} --host {host} --port {port}"
MODES = ("passthrough", "admission")

# An SLO class: (TTFT ms, TPOT ms, priority, share of traffic). The load generator gets them
# through JSON, as lists of those four numbers.
SloClass = tuple[float, float, int, float]
# What judging a request needs of its class: (TTFT ms, TPOT ms).
SloTargets = dict[str, tuple[float, float]]

CLASSES: dict[str, SloClass] = {
    "interactive": (1000.0, 50.0, 10, 0.7),
    "batch": (30000.0, 200.0, 0, 0.3),
}
SHORT = (150, 250)  # prompt tokens, uniform
LONG = (1500, 2500)
LONG_SHARE = 0.2
OUT_MEDIAN, OUT_SIGMA, OUT_MIN, OUT_MAX = 100.0, 0.5, 16, 400
BYTES_PER_TOKEN = 4  # the simulator's default: prompt tokens = ceil(content bytes / 4)
PCTS = (50, 90, 99)


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------

def draw_request(rng: random.Random,
                 classes: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    u = rng.random()
    acc = 0.0
    cls = next(iter(classes))
    for name, (_, _, _, share) in classes.items():
        acc += share
        if u < acc:
            cls = name
            break
    lo, hi = LONG if rng.random() < LONG_SHARE else SHORT
    prompt = rng.randint(lo, hi)
    out = int(round(rng.lognormvariate(math.log(OUT_MEDIAN), OUT_SIGMA)))
    return {"cls": cls, "prompt": prompt, "out": max(OUT_MIN, min(OUT_MAX, out))}


def make_schedule(rate: float, segments: list[float], seed: int, probe_fraction: float,
                  classes: Mapping[str, Sequence[float]]) -> list[dict[str, Any]]:
    """Poisson arrivals conditioned on their count in each segment (warm-up, window, tail):
    round(rate * length) arrivals at sorted uniform times in each, so the measured window gets
    exactly the offered rate. [{i, t, cls, prompt, out, probe}], t in seconds from the start."""
    rng = random.Random(seed)
    times: list[float] = []
    start = 0.0
    for length in segments:
        times += sorted(rng.uniform(start, start + length)
                        for _ in range(int(round(rate * length))))
        start += length
    out: list[dict[str, Any]] = []
    for t in times:
        req = draw_request(rng, classes)
        req.update(i=len(out), t=t, probe=rng.random() < probe_fraction)
        out.append(req)
    return out


def workload_means() -> tuple[float, float]:
    """E[prompt tokens], E[output tokens] of the mix (the output clamp by numeric integration)."""
    e_prompt = (1 - LONG_SHARE) * sum(SHORT) / 2 + LONG_SHARE * sum(LONG) / 2
    rng = random.Random(12345)
    n = 200_000
    e_out = sum(max(OUT_MIN, min(OUT_MAX, int(round(rng.lognormvariate(
        math.log(OUT_MEDIAN), OUT_SIGMA))))) for _ in range(n)) / n
    return e_prompt, e_out


def derived_capacity(sim: dict[str, float]) -> dict[str, float]:
    """Service rate of the simulator's step model with a full batch B: per second,
    steps * (base + per_seq * B) + prompt tokens / prefill rate = 1, steps = λ E[out] / B."""
    e_prompt, e_out = workload_means()
    b = sim["max_batch"]
    per_req = (e_out * (sim["decode_base_ms"] / b + sim["decode_per_seq_ms"]) / 1000.0
               + e_prompt / sim["prefill_tokens_per_s"])
    full_step = (sim["decode_base_ms"] + sim["decode_per_seq_ms"] * b) / 1000.0
    return {"req_per_s": 1.0 / per_req, "mean_prompt_tokens": e_prompt,
            "mean_output_tokens": e_out, "full_batch_step_ms": full_step * 1e3}


_FILL = b"the quick brown fox jumps over the lazy dog while the engine keeps its batch full "


def prompt_text(i: int, tokens: int) -> str:
    n = tokens * BYTES_PER_TOKEN
    head = f"req {i}: ".encode()
    body = (head + _FILL * (n // len(_FILL) + 2))[:n]
    return body.decode()


# ---------------------------------------------------------------------------------------------
# Load generator (own process: `goodput.py --client-spec SPEC --client-out OUT`)
# ---------------------------------------------------------------------------------------------

_CONTENT = b'"content":"'
_ERROR = b'"error"'


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


async def _client_run(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp
    import orjson

    clock = time.perf_counter
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, force_close=False)
    session = aiohttp.ClientSession(
        connector=connector, auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None),
        skip_auto_headers=("User-Agent", "Accept-Encoding"))
    url = spec["url"]
    records: list[dict[str, Any]] = []
    open_tasks: dict[asyncio.Task[None], dict[str, Any]] = {}
    mine: set[asyncio.Task[None]] = set()  # arrival and probe tasks not finished yet

    def spawn(coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        mine.add(task)
        task.add_done_callback(mine.discard)
    t0 = clock() + 0.2
    lags: list[float] = []
    pending_probes = [0]  # probes waiting for their Retry-After or their answer
    w_from = spec.get("warmup", 0.0)  # the measured window, in seconds from t0
    w_to = w_from + spec["window"]

    async def fire(req: dict[str, Any], t_at: float, probe_of: int | None = None) -> None:
        n_out = 1 if probe_of is not None else req["out"]
        rec: dict[str, Any] = {"i": req["i"], "cls": req["cls"], "prompt": req["prompt"],
                               "out": n_out, "t_sched": t_at - t0, "probe_of": probe_of,
                               "status": None, "n": 0, "error": None}
        records.append(rec)
        task = asyncio.current_task()
        assert task is not None  # fire() always runs as a task (at, probe_later, a worker)
        open_tasks[task] = rec
        body = orjson.dumps({"model": "sim", "stream": True, "max_tokens": n_out,
                             "messages": [{"role": "user",
                                           "content": prompt_text(req["i"], req["prompt"])}]})
        key = spec.get("keys", {}).get(req["cls"], "bench")
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}",
                   "x-sim-output-tokens": str(n_out), "x-slo-class": req["cls"]}
        t_send = clock()
        rec["t_send"] = t_send - t0
        lags.append(t_send - t_at)
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                rec["status"] = resp.status
                rec["t_headers"] = clock() - t0
                if resp.status != 200:
                    await resp.read()
                    ra = resp.headers.get("Retry-After")
                    rec["retry_after"] = float(ra) if ra is not None else None
                    rec["reason"] = resp.headers.get("x-slogate-admission")
                    if (resp.status == 429 and probe_of is None and req.get("probe")
                            and rec["retry_after"] is not None and not spec.get("no_probes")
                            and w_from <= rec["t_headers"] < w_to):
                        pending_probes[0] += 1
                        spawn(probe_later(req, clock() + rec["retry_after"]))
                    return
                buf = b""
                first = None
                last = 0.0
                n = 0
                n_win = 0
                w0, w1 = spec.get("count_from", math.inf), spec.get("count_to", -math.inf)
                async for chunk in resp.content.iter_any():
                    t = clock()
                    buf = buf + chunk if buf else chunk
                    pos = 0
                    find = buf.find
                    while True:
                        end = find(b"\n\n", pos)
                        if end < 0:
                            break
                        j = find(_CONTENT, pos, end)
                        if j >= 0 and buf[j + 11] != 34:
                            n += 1
                            if w0 <= t - t0 < w1:
                                n_win += 1
                            if first is None:
                                first = t
                                rec["t_first"] = t - t0
                            last = t
                        elif find(_ERROR, pos, end) >= 0:
                            rec["error"] = "stream_error_event"
                        pos = end + 2
                    buf = buf[pos:] if pos < len(buf) else b""
                    rec["n"] = n
                    if n_win:
                        rec["n_win"] = n_win
                if first is not None:
                    rec["t_last"] = last - t0
                rec["t_end"] = clock() - t0
        except asyncio.CancelledError:
            rec.setdefault("cancelled", "cancelled")
            rec["t_cancel"] = clock() - t0
        except Exception as e:  # counted; the table shows it
            rec["error"] = type(e).__name__
            rec["t_end"] = clock() - t0
        finally:
            open_tasks.pop(task, None)

    async def probe_later(req: dict[str, Any], t_at: float) -> None:
        try:
            await asyncio.sleep(max(0.0, t_at - clock()))
            await fire(req, t_at, probe_of=req["i"])
        finally:
            pending_probes[0] -= 1

    async def at(req: dict[str, Any]) -> None:
        t_at = t0 + req["t"]
        await asyncio.sleep(max(0.0, t_at - clock()))
        await fire(req, t_at)

    def spawn_at(req: dict[str, Any]) -> asyncio.Task[None]:
        return asyncio.ensure_future(at(req))

    samples: list[dict[str, Any]] = []

    async def poll() -> None:
        while True:
            s: dict[str, Any] = {"t": clock() - t0}
            for key, u in (("admission", spec.get("admin_url")),
                           ("sim", spec.get("sim_stats_url"))):
                if not u:
                    continue
                try:
                    async with session.get(u, headers=spec.get("admin_headers")
                                           if key == "admission" else None) as r:
                        d = await r.json(content_type=None)
                except Exception:
                    continue
                if key == "admission":
                    if d.get("enabled"):
                        rep: dict[str, Any] = next(iter(d.get("replicas", {}).values()), {})
                        s["queue"] = d["queue"]["requests"]
                        s["queue_tokens"] = d["queue"]["estimated_tokens"]
                        s["queue_by_class"] = d["queue"]["by_class"]
                        s["gw_prefilling"] = rep.get("prefilling")
                        s["gw_prefill_tokens"] = rep.get("prefill_tokens")
                        s["gw_decoding"] = rep.get("decoding")
                        s["gw_by_class"] = rep.get("by_class")
                        s["gw_limit"] = rep.get("limit")
                        s["gw_proven"] = (rep.get("concurrency") or {}).get("proven")
                        s["gw_ttft_model"] = rep.get("ttft_model")
                        s["gw_ttft_tenants"] = rep.get("ttft_tenants")
                        s["gw_classes"] = d.get("classes")
                else:
                    s["sim_running"] = d.get("running")
                    s["sim_waiting"] = d.get("waiting")
            samples.append(s)
            await asyncio.sleep(spec.get("poll_s", 0.5))

    poller = asyncio.ensure_future(poll())
    if spec["mode"] == "closed":
        result = await _closed_loop(spec, fire, clock, t0, records)
    else:
        arrivals = [spawn_at(req) for req in spec["schedule"]]
        await asyncio.sleep(max(0.0, t0 + w_to - clock()))
        snapshot = None
        if spec.get("admin_url"):
            with contextlib.suppress(Exception):
                async with session.get(spec["admin_url"]) as r:
                    snapshot = await r.json(content_type=None)
        # Arrivals go on (the system stays loaded) while retry probes are pending.
        tail_until = t0 + w_to + spec["tail_cap"]
        while clock() < tail_until and pending_probes[0]:
            await asyncio.sleep(0.05)
        t_stop = clock()
        for task in arrivals:
            task.cancel()
        for task, rec in list(open_tasks.items()):
            rec["cancelled"] = "open_at_end"
            task.cancel()
        await asyncio.gather(*arrivals, *list(mine), return_exceptions=True)
        result = {"tail_s": t_stop - (t0 + w_to), "admin_end_of_window": snapshot}
    poller.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await poller
    await session.close()
    result.update(records=records, samples=samples,
                  lag_ms={"p50": (_pct(lags, 50) or 0) * 1e3, "p99": (_pct(lags, 99) or 0) * 1e3,
                          "max": max(lags, default=0) * 1e3})
    return result


async def _closed_loop(spec: dict[str, Any],
                       fire: Callable[[dict[str, Any], float], Awaitable[None]],
                       clock: Callable[[], float], t0: float,
                       records: list[dict[str, Any]]) -> dict[str, Any]:
    """`workers` workers, one request after another, the benchmark's mix; for the capacity."""
    stop = False
    warm, window = spec["warmup"], spec["window"]
    w0, w1 = t0 + warm, t0 + warm + window
    counter = iter(range(10**9))

    async def worker(k: int) -> None:
        rng = random.Random(spec["seed"] * 1000 + k)
        await asyncio.sleep(0.05 * k)
        while not stop:
            req = draw_request(rng, spec["classes"])
            req["i"] = next(counter)
            await fire(req, clock())

    tasks = [asyncio.ensure_future(worker(k)) for k in range(spec["workers"])]
    await asyncio.sleep(max(0.0, w1 - clock()))
    stop = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    done = [r for r in records if r.get("t_end") is not None and r["status"] == 200
            and w0 - t0 <= r["t_end"] < w1 - t0]
    # Requests' worth of work done in the window: each request's share of its output tokens
    # that arrived in the window (much less noisy than counting completions in a few seconds).
    work = sum(r.get("n_win", 0) / r["out"] for r in records)
    return {"window_s": window, "completed_in_window": len(done), "work_in_window": work}


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


class BenchProcs(Procs):
    """overhead.py's process set, watching this benchmark's two gateways as well as the sim."""

    WATCHED: tuple[str, ...] = ("sim", *MODES)

    def check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None and name in self.WATCHED:
                raise RuntimeError(f"{name} exited with status {p.returncode}; see "
                                   f"{self.logdir / (name + '.log')}:\n{self.tail(name)}")


def run_client(procs: Procs, tmp: Path, tag: str, spec: dict[str, Any],
               cpus: set[int] | None) -> dict[str, Any]:
    limit = spec.get("warmup", 0) + spec["window"] + spec.get("tail_cap", 0) + 60
    return run_json_process(procs, tmp, tag, "benchmarks.goodput", spec, cpus, limit)


# ---------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------

def judge(rec: dict[str, Any], slo: SloTargets) -> dict[str, Any]:
    """TTFT/TPOT (s) and whether the request met its class's SLO."""
    ttft_ms, tpot_ms = slo[rec["cls"]][0], slo[rec["cls"]][1]
    out: dict[str, Any] = {"ttft": None, "tpot": None, "met": False}
    if "t_first" in rec:
        out["ttft"] = rec["t_first"] - rec["t_send"]
    if "t_last" in rec and rec["n"] > 1:
        out["tpot"] = (rec["t_last"] - rec["t_first"]) / (rec["n"] - 1)
    complete = (rec["status"] == 200 and not rec.get("cancelled") and rec["error"] is None
                and rec["n"] == rec["out"])
    out["complete"] = complete
    out["met"] = bool(complete and out["ttft"] is not None and out["ttft"] * 1e3 <= ttft_ms
                      and (out["tpot"] is None or out["tpot"] * 1e3 <= tpot_ms))
    return out


def _lat(values: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(values)}
    for p in PCTS:
        v = _pct(values, p)
        out[f"p{p}"] = None if v is None else v * 1e3
    return out


def summarize(run: dict[str, Any], warmup: float, window: float,
              slo: SloTargets) -> dict[str, Any]:
    """Rates in the window [warmup, warmup + window) (seconds from the load generator's t0)."""
    w0, w1 = warmup, warmup + window

    def inw(t: float | None) -> bool:
        return t is not None and w0 <= t < w1

    recs = run["records"]
    main = [r for r in recs if r["probe_of"] is None]
    probes = [r for r in recs if r["probe_of"] is not None]
    by_i = {r["i"]: r for r in main}
    s: dict[str, Any] = {"offered_rps": sum(1 for r in main if inw(r["t_sched"])) / window,
                         "tail_s": run.get("tail_s"), "client_lag_ms": run.get("lag_ms"),
                         "classes": {}}
    for cls in [*slo, "all"]:
        rs = [r for r in main if cls == "all" or r["cls"] == cls]
        js = [(r, judge(r, slo)) for r in rs]
        arrived = sum(1 for r in rs if inw(r["t_sched"]))
        finished = [(r, j) for r, j in js if j["complete"] and inw(r.get("t_end"))]
        met = sum(1 for _, j in finished if j["met"])
        rejected = [r for r in rs if r["status"] == 429 and inw(r.get("t_headers"))]
        ttft = [j["ttft"] for r, j in js if j["ttft"] is not None and inw(r.get("t_first"))]
        tpot = [j["tpot"] for _, j in finished if j["tpot"] is not None]
        ttft_slo = slo[cls][0] / 1e3 if cls != "all" else None
        first_in_slo = sum(1 for r, j in js if j["ttft"] is not None and inw(r.get("t_first"))
                           and j["ttft"] <= (ttft_slo or slo[r["cls"]][0] / 1e3))
        # Arrivals of the window still waiting for a first token at its end, already late.
        late_open = sum(1 for r in rs if inw(r["t_sched"]) and "t_first" not in r
                        and r.get("cancelled") == "open_at_end" and r["status"] in (None, 200)
                        and run.get("t_end_window", w1) - r["t_send"] > slo[r["cls"]][0] / 1e3)
        other: Counter[str] = Counter()
        for r in rs:
            if not inw(r.get("t_end") or r.get("t_headers")):
                continue
            if r["status"] not in (200, 429):
                kind = f"http_{r['status']}" if r["status"] else (r.get("error") or "no_status")
                other[kind] += 1
            elif r["status"] == 200 and r["error"]:
                other[r["error"]] += 1
        cp = [p for p in probes if cls == "all" or p["cls"] == cls]
        p_ok = [p for p in cp if p["status"] == 200]
        p_met = [p for p in p_ok if "t_first" in p
                 and (p["t_first"] - p["t_send"]) * 1e3 <= slo[p["cls"]][0]]
        ras = [by_i[p["probe_of"]]["retry_after"] for p in cp if p["probe_of"] in by_i]
        s["classes"][cls] = {
            "arrived": arrived, "finished": len(finished), "met": met,
            "goodput_rps": met / window, "served_rps": len(finished) / window,
            "attainment": met / arrived if arrived else None,  # goodput / offered
            "rejected": len(rejected),
            "rejection_rate": len(rejected) / arrived if arrived else None,
            "reject_reasons": dict(Counter(r.get("reason") or "?" for r in rejected)),
            "first_tokens": len(ttft), "first_tokens_in_ttft_slo": first_in_slo,
            "late_open_at_end": late_open, "other": dict(other),
            "ttft_ms": _lat(ttft), "tpot_ms": _lat(tpot),
            "retry_probes": {
                "n": len(cp), "admitted": len(p_ok), "admitted_and_ttft_met": len(p_met),
                "admitted_rate": len(p_ok) / len(cp) if cp else None,
                "ttft_met_rate": len(p_met) / len(cp) if cp else None,
                "unanswered": sum(1 for p in cp if p["status"] is None),
                "rejected_again_reasons": dict(Counter(p.get("reason") or "?" for p in cp
                                                       if p["status"] == 429)),
                "retry_after_s": {"p50": _pct(ras, 50), "max": max(ras, default=None)},
            },
        }
    s["goodput_rps"] = s["classes"]["all"]["goodput_rps"]
    win = [x for x in run.get("samples", []) if w0 <= x["t"] < w1]

    def agg(key: str) -> dict[str, Any]:
        v = [x[key] for x in win if x.get(key) is not None]
        return {"mean": sum(v) / len(v) if v else None, "max": max(v, default=None)}
    s["queue"] = {k: agg(k) for k in ("queue", "queue_tokens", "gw_prefilling",
                                      "gw_prefill_tokens", "gw_decoding", "sim_running",
                                      "sim_waiting")}
    by_cls: dict[str, int] = defaultdict(int)
    for x in win:
        for k, v in (x.get("queue_by_class") or {}).items():
            by_cls[k] = max(by_cls[k], v)
    s["queue"]["max_by_class"] = dict(by_cls)
    return s


def scrape_metrics(url: str) -> dict[str, Any]:
    """Admission decisions {(class, decision, reason): n} and TTFT prediction error sum/count."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    dec: dict[str, float] = {}
    err_sum = err_count = 0.0
    verdicts: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "slogate_admission_decisions_total":
                k = f"{smp.labels['slo_class']}|{smp.labels['decision']}|{smp.labels['reason']}"
                dec[k] = dec.get(k, 0.0) + smp.value
            elif smp.name == "slogate_ttft_prediction_error_seconds_sum":
                err_sum += smp.value
            elif smp.name == "slogate_ttft_prediction_error_seconds_count":
                err_count += smp.value
            elif smp.name == "slogate_slo_requests_total":
                k = f"{smp.labels['slo_class']}|{smp.labels['verdict']}"
                verdicts[k] = verdicts.get(k, 0.0) + smp.value
    return {"decisions": dec, "ttft_err_sum": err_sum, "ttft_err_count": err_count,
            "verdicts": verdicts}


def metrics_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    if not a or not b:
        return {}
    dec = {k: v - a["decisions"].get(k, 0.0) for k, v in b["decisions"].items()
           if v - a["decisions"].get(k, 0.0) > 0}
    ver = {k: v - a["verdicts"].get(k, 0.0) for k, v in b["verdicts"].items()
           if v - a["verdicts"].get(k, 0.0) > 0}
    n = b["ttft_err_count"] - a["ttft_err_count"]
    return {"decisions": dict(sorted(dec.items())), "gateway_verdicts": dict(sorted(ver.items())),
            "ttft_prediction_abs_error_mean_ms":
                (b["ttft_err_sum"] - a["ttft_err_sum"]) / n * 1e3 if n else None,
            "ttft_prediction_observations": n}


def get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def wait_quiet(sim_stats: str, admin: str | None, timeout: float = 60.0) -> dict[str, Any]:
    """Until the engine and the admission queue are empty (between runs)."""
    t_end = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < t_end:
        st = get_json(sim_stats) or {}
        q = (get_json(admin) or {}).get("queue", {}).get("requests", 0) if admin else 0
        if st.get("running", 1) == 0 and st.get("waiting", 1) == 0 and not q:
            return {"quiet": True}
        time.sleep(0.2)
    return {"quiet": False, "sim": {k: st.get(k) for k in ("running", "waiting")}}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def fmt(v: Any, spec: str = ".0f", lb: bool = False) -> str:
    if v is None:
        return "–"
    return ("≥" if lb else "") + format(v, spec)


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.0f}%"


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    pts = results["points"]

    def at(mult: float) -> dict[str, Any] | None:
        return next((p for p in pts if abs(p["load"] - mult) < 1e-9), None)
    one, two = at(1.0), at(2.0)
    out: dict[str, Any] = {"capacity_rps": results["capacity"]["used_rps"]}
    if one is None or two is None or not all(m in one and m in two for m in MODES):
        out["note"] = "the target needs both modes at the 1x and 2x points"
        return out
    peak = max(one[m]["goodput_rps"] for m in MODES)
    a2, p2 = two["admission"], two["passthrough"]
    i2 = a2["classes"]["interactive"]
    ratio = a2["goodput_rps"] / peak if peak else None
    out.update({
        "peak_goodput_at_capacity_rps": peak,
        "admission_goodput_2x_rps": a2["goodput_rps"],
        "admission_ratio_2x": ratio,
        "passthrough_goodput_2x_rps": p2["goodput_rps"],
        "passthrough_ratio_2x": p2["goodput_rps"] / peak if peak else None,
        "admitted_interactive_p99_ttft_ms_2x": i2["ttft_ms"]["p99"],
        "goodput_target_met": ratio is not None and ratio >= 0.9,
        "interactive_p99_ttft_target_met": (i2["ttft_ms"]["p99"] is not None
                                            and i2["ttft_ms"]["p99"] <= CLASSES["interactive"][0]),
    })
    return out


def _model(m: dict[str, Any]) -> str:
    """An estimator's coefficients from /admin/admission, as `name value` pairs."""
    return ", ".join(f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}"
                     for k, v in m.items() if k != "observations") or "–"


def render(results: dict[str, Any]) -> str:
    m = results["meta"]
    c = results["capacity"]
    sim = m["sim"]
    modes = [mo for mo in MODES if any(mo in p for p in results["points"])]
    lines = [
        f"### slogate goodput — admission on vs pass-through "
        f"({m['warmup_s']:g} s warm-up + {m['window_s']:g} s measured per point)",
        "",
        f"Simulator: max batch {sim['max_batch']}, decode {sim['decode_base_ms']:g} ms + "
        f"{sim['decode_per_seq_ms']:g} ms/seq, prefill {sim['prefill_tokens_per_s']:g} tok/s "
        f"(chunks of {sim['prefill_chunk_tokens']}). Mix: {int((1 - LONG_SHARE) * 100)} % prompts "
        f"{SHORT[0]}–{SHORT[1]} tokens, {int(LONG_SHARE * 100)} % {LONG[0]}–{LONG[1]}; output "
        f"lognormal median {OUT_MEDIAN:g} ({OUT_MIN}–{OUT_MAX}). Classes: "
        + "; ".join(f"{n} {v[3] * 100:.0f} % (TTFT {v[0]:g} ms, TPOT {v[1]:g} ms, prio {v[2]})"
                    for n, v in m["classes"].items()) + "."
        + (f" Admission gateway extra config: `{m['admission_extra']}`."
           if m.get("admission_extra") else ""),
        "",
        f"Capacity: **{c['used_rps']:.2f} req/s** ({c['source']}"
        + (f": {c['measured']['workers']} closed-loop workers straight to the sim, the batch "
           f"always full; interactive SLO at that rate: TTFT p99 "
           f"{fmt(c['measured']['ttft_p99_ms'])} ms, TPOT p99 "
           f"{fmt(c['measured']['tpot_p99_ms'], '.1f')} ms" if c.get("measured") else "")
        + f"); derived from the simulator's step model: {c['derived']['req_per_s']:.2f} req/s.",
        "",
        "| load | mode | offered req/s | goodput req/s | interactive | batch | goodput ÷ offered "
        "| rejected (int / batch) | int TTFT p50 / p99 ms | int TPOT p50 / p99 ms "
        "| batch TTFT p50 / p99 ms | retry at Retry-After admitted (TTFT met) "
        "| admission queue max (int / batch) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in results["points"]:
        for mode in modes:
            if mode not in p:
                continue
            s = p[mode]
            ci, cb, ca = s["classes"]["interactive"], s["classes"]["batch"], s["classes"]["all"]
            ti, tp, tb = ci["ttft_ms"], ci["tpot_ms"], cb["ttft_ms"]
            rp = ca["retry_probes"]
            q = s["queue"]["max_by_class"]
            lines.append(
                f"| {p['load']:g}× | {mode} | {s['offered_rps']:.2f} | **{s['goodput_rps']:.2f}** "
                f"| {ci['goodput_rps']:.2f} | {cb['goodput_rps']:.2f} | {pct(ca['attainment'])} "
                f"| {pct(ci['rejection_rate'])} / {pct(cb['rejection_rate'])} "
                f"| {fmt(ti['p50'])} / {fmt(ti['p99'])} "
                f"| {fmt(tp['p50'], '.1f')} / {fmt(tp['p99'], '.1f')} "
                f"| {fmt(tb['p50'])} / {fmt(tb['p99'])} "
                + (f"| {pct(rp['admitted_rate'])} ({pct(rp['ttft_met_rate'])}) of {rp['n']} "
                   if rp["n"] else "| – ")
                + (f"| {q.get('interactive', 0)} / {q.get('batch', 0)} |" if mode == "admission"
                   else "| – |"))
    v = results.get("verdict", {})
    lines += [
        "",
        "All columns are rates or latencies in the measured window, after the warm-up at the "
        "same load. goodput = requests that finished in the window having met both SLOs "
        "(TTFT and TPOT, every token delivered) ÷ window; goodput ÷ offered = that over the "
        "arrival rate. TTFT: first tokens in the window; TPOT: requests finished in it; both "
        "client-measured, admitted requests only. rejected = 429s ÷ arrivals. retry: a sample of "
        "the requests rejected in the window sent again exactly Retry-After later (1 output "
        "token); share admitted, and in brackets admitted with TTFT in SLO. Admission queue: "
        "depth by class from GET /admin/admission, twice a second.",
    ]
    if "admission_ratio_2x" in v:
        lines += [
            "",
            f"**Target at 2× capacity:** admission goodput {v['admission_goodput_2x_rps']:.2f} "
            f"req/s = **{v['admission_ratio_2x'] * 100:.0f} %** of the peak goodput at capacity "
            f"({v['peak_goodput_at_capacity_rps']:.2f} req/s, the better mode at 1×; target "
            f"≥ 90 %: {'met' if v['goodput_target_met'] else 'MISSED'}); pass-through "
            f"{v['passthrough_goodput_2x_rps']:.2f} req/s "
            f"({v['passthrough_ratio_2x'] * 100:.0f} %). "
            f"Admitted interactive P99 TTFT at 2×: "
            f"{fmt(v['admitted_interactive_p99_ttft_ms_2x'])} ms (SLO "
            f"{CLASSES['interactive'][0]:g} ms: "
            f"{'met' if v['interactive_p99_ttft_target_met'] else 'MISSED'}).",
        ]
    if "admission" in modes:
        lines += ["", "Admission internals (gateway /metrics deltas over the run, GET "
                      "/admin/admission at the end of the window, engine /sim/stats):", "",
                  "| load | decisions: class decision/reason n | mean abs TTFT pred. error ms "
                  "| TTFT model at the end of the window "
                  "| TPOT model | gw prefilling / decoding max "
                  "| engine running mean / waiting max |",
                  "|---:|---|---:|---|---|---:|---:|"]
        for p in results["points"]:
            if "admission" not in p:
                continue
            s = p["admission"]
            d = s.get("gateway", {})
            dec = ", ".join(f"{k.replace('|', ' ', 1).replace('|', '/')} {n:.0f}"
                            for k, n in d.get("decisions", {}).items())
            snap = s.get("admin_end_of_window") or {}
            rep: dict[str, Any] = next(iter((snap.get("replicas") or {}).values()), {})
            tm, pm = rep.get("ttft_model", {}), rep.get("tpot_model", {})
            q = s["queue"]
            lines.append(
                f"| {p['load']:g}× | {dec or '–'} "
                f"| {fmt(d.get('ttft_prediction_abs_error_mean_ms'))} "
                f"| {_model(tm)} | {_model(pm)} "
                f"| {fmt(q['gw_prefilling']['max'])} / {fmt(q['gw_decoding']['max'])} "
                f"| {fmt(q['sim_running']['mean'], '.1f')} / {fmt(q['sim_waiting']['max'])} |")
    lag = max((p[mo]["client_lag_ms"]["p99"] for p in results["points"] for mo in modes
               if mo in p), default=0)
    if lag > 50:
        lines += ["", f"**Warning:** the load generator's P99 send lag reached {lag:.0f} ms: the "
                      "machine was busy; arrivals were not quite Poisson."]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -e '.[bench]'); no plot"
    pts = results["points"]
    cap = results["capacity"]["used_rps"]
    x = [p["load"] for p in pts]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    style = {"passthrough": ("tab:red", "pass-through"), "admission": ("tab:blue", "admission on")}
    for mode in [mo for mo in MODES if all(mo in p for p in pts)]:
        col, label = style[mode]
        ax.plot(x, [p[mode]["goodput_rps"] for p in pts], "o-", color=col, lw=2,
                label=f"{label}: total")
        ax.plot(x, [p[mode]["classes"]["interactive"]["goodput_rps"] for p in pts], "s--",
                color=col, alpha=0.6, label=f"{label}: interactive")
        ax.plot(x, [p[mode]["classes"]["batch"]["goodput_rps"] for p in pts], "^:",
                color=col, alpha=0.6, label=f"{label}: batch")
        ttft = [p[mode]["classes"]["interactive"]["ttft_ms"]["p99"] for p in pts]
        ax2.plot(x, [t if t else float("nan") for t in ttft], "o-", color=col, label=label)
    xs = [0, max(x) * 1.05]
    ax.plot([0, 1, max(x) * 1.05], [0, cap, cap], color="grey", lw=1, ls="-.",
            label=f"capacity {cap:.2f} req/s")
    peak = results.get("verdict", {}).get("peak_goodput_at_capacity_rps")
    if peak:
        ax.axhline(0.9 * peak, color="green", lw=0.8, ls=":", label="90 % of peak goodput at 1×")
    ax.set_xlabel("offered load (× capacity)")
    ax.set_ylabel("goodput (req/s meeting TTFT and TPOT SLO)")
    ax.set_xlim(xs)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("Goodput vs offered load")
    ax2.axhline(CLASSES["interactive"][0], color="green", ls=":", label="interactive TTFT SLO")
    ax2.set_yscale("log")
    ax2.set_xlabel("offered load (× capacity)")
    ax2.set_ylabel("P99 TTFT of admitted interactive requests (ms)")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(fontsize=8)
    ax2.set_title("Admitted interactive P99 TTFT")
    fig.suptitle(f"slogate goodput benchmark ({results['meta']['git']})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------------------------

def admission_toml(enabled: bool, extra: str) -> str:
    out = f"\n[admission]\nenabled = {'true' if enabled else 'false'}\n{extra}\n"
    out += '\n[slo]\ndefault = "interactive"\n'
    for name, (ttft, tpot, prio, _) in CLASSES.items():
        out += (f'\n[[slo_classes]]\nname = "{name}"\nttft_ms = {ttft:g}\ntpot_ms = {tpot:g}\n'
                f"priority = {prio}\n")
    return out


def probe_stream(url: str, cls: str) -> tuple[int, int]:
    body = json.dumps({"model": "sim", "stream": True, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": "Bearer bench",
        "x-sim-output-tokens": "4", "x-slo-class": cls})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, 0
    return status, sum(1 for ev in data.split(b"\n\n")
                       if (j := ev.find(_CONTENT)) >= 0 and ev[j + 11:j + 12] != b'"')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: loads 1,2, 3 s warm-up + 6 s window, 4 s capacity loop")
    ap.add_argument("--loads", help="offered loads in × capacity (default 0.5,1,1.5,2,3)")
    ap.add_argument("--window", type=float, help="seconds of arrivals per point (default 15)")
    ap.add_argument("--warmup", type=float,
                    help="unmeasured seconds of the same load before each window (default 5)")
    ap.add_argument("--tail-cap", type=float,
                    help="after the window, arrivals go on while retry probes are pending, at "
                         "most this long (default 8 s)")
    ap.add_argument("--capacity", type=float,
                    help="use this capacity (req/s) instead of measuring it")
    ap.add_argument("--capacity-window", type=float, help="closed-loop seconds (default 10)")
    ap.add_argument("--probe-fraction", type=float, default=0.25,
                    help="share of rejected requests retried at Retry-After (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-batch", type=int, help="the simulator's (default 16; --matrix: 8)")
    ap.add_argument("--decode-base-ms", type=float, default=10.0)
    ap.add_argument("--decode-per-seq-ms", type=float, default=1.0)
    ap.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    ap.add_argument("--prefill-chunk-tokens", type=int, default=2048)
    ap.add_argument("--admission-extra", default="",
                    help="TOML lines added to the admission gateway's [admission] table, "
                         "e.g. 'max_concurrency = 16'")
    ap.add_argument("--modes", default=",".join(MODES), help="which gateways to measure")
    ap.add_argument("--out", default="bench-results/goodput.json")
    ap.add_argument("--markdown", default="bench-results/goodput.md")
    ap.add_argument("--plot", default="bench-results/goodput.png")
    ap.add_argument("--raw", action="store_true", help="keep every request's record in the JSON")
    ap.add_argument("--sim-cmd", default=DEFAULT_SIM_CMD)
    ap.add_argument("--gateway-cmd", default=DEFAULT_GATEWAY_CMD)
    ap.add_argument("--gateway-cpu", help="CPU list for the gateways (default: 2nd allowed CPU)")
    ap.add_argument("--sim-cpu", help="CPU list for the simulator (default: 1st allowed CPU)")
    ap.add_argument("--client-cpu", help="CPU list for the load generator (default: the sim's)")
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--decisions", type=Path, metavar="DIR",
                    help="--fairness/--matrix: save each run's decision log (the flight "
                    "recorder's ring, GET /admin/decisions) to DIR/<run>.jsonl")
    ap.add_argument("--fairness", action="store_true",
                    help="the fairness runs instead (issue 11): equal classes, priority with "
                         "min_share, a tenant at 10x its quota; admission with its defaults")
    ap.add_argument("--matrix", action="store_true",
                    help="the fairness matrix instead: two and three classes, TTFT targets 2x-20x "
                         "the unloaded TTFT, loads 1.2x-3x, equal and unequal weights, a tenant "
                         "flooding (sim batch 8 unless --max-batch; BENCH_FAIR_SCENARIOS=a,b "
                         "picks cells)")
    ap.add_argument("--client-spec", help=argparse.SUPPRESS)
    ap.add_argument("--client-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_spec:
        return client_main(args.client_spec, args.client_out)
    harness.NICE = args.nice
    if args.max_batch is None:
        args.max_batch = 8 if args.matrix else 16
    if args.fairness or args.matrix:
        return fairness_main(args)

    q = args.quick
    loads = [float(x) for x in (args.loads or ("1,2" if q else "0.5,1,1.5,2,3")).split(",")]
    window = args.window or (6.0 if q else 15.0)
    warmup = args.warmup if args.warmup is not None else (3.0 if q else 5.0)
    tail_cap = args.tail_cap if args.tail_cap is not None else 8.0
    cap_window = args.capacity_window or (4.0 if q else 10.0)
    modes = [m for m in args.modes.split(",") if m]
    slo = {n: (v[0], v[1]) for n, v in CLASSES.items()}

    allowed = sorted(os.sched_getaffinity(0))
    two = len(allowed) >= 2
    gw_cpus = parse_cpus(args.gateway_cpu, allowed, allowed[1] if two else None)
    sim_cpus = parse_cpus(args.sim_cpu, allowed, allowed[0] if two else None)
    client_cpus = parse_cpus(args.client_cpu, allowed, None) if args.client_cpu else sim_cpus
    placement = {"gateway": fmt_cpus(gw_cpus), "sim": fmt_cpus(sim_cpus),
                 "client": fmt_cpus(client_cpus)}

    tmp = Path(tempfile.mkdtemp(prefix="slogate-goodput-"))
    procs = BenchProcs(tmp)
    host = args.host
    sim_knobs = {"max_batch": args.max_batch, "decode_base_ms": args.decode_base_ms,
                 "decode_per_seq_ms": args.decode_per_seq_ms,
                 "prefill_tokens_per_s": args.prefill_tokens_per_s,
                 "prefill_chunk_tokens": args.prefill_chunk_tokens}
    sim_port = free_port(host)
    ports = {m: free_port(host) for m in MODES}
    subst = {"python": shlex.quote(sys.executable), "host": host,
             **{k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in sim_knobs.items()}}
    sim_argv = shlex.split(args.sim_cmd.format(**subst, port=sim_port))
    gw_argv: dict[str, list[str]] = {}
    for mode in MODES:
        cfg = tmp / f"gateway-{mode}.toml"
        # The admission gateway knows the engine's batch size, as its operator would
        # (vLLM's max_num_seqs): requests then wait where priority can order them, not in the
        # engine's FIFO.
        extra = f"max_concurrency = {args.max_batch}\n{args.admission_extra}"
        cfg.write_text(gateway_config(host, ports[mode], sim_port, 1024, admission_toml(
            mode == "admission", extra if mode == "admission" else "")))
        gw_argv[mode] = shlex.split(args.gateway_cmd.format(**subst, config=str(cfg),
                                                           port=ports[mode]))
    sim_base = f"http://{host}:{sim_port}"
    urls = {m: f"http://{host}:{ports[m]}" for m in MODES}

    results: dict[str, Any] = {
        "meta": {
            "benchmark": "goodput",
            "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "git": git_rev(), "window_s": window, "warmup_s": warmup, "tail_cap_s": tail_cap,
            "loads": loads, "seed": args.seed, "probe_fraction": args.probe_fraction,
            "sim": sim_knobs, "classes": {n: list(v) for n, v in CLASSES.items()},
            "workload": {"short": SHORT, "long": LONG, "long_share": LONG_SHARE,
                         "out_median": OUT_MEDIAN, "out_sigma": OUT_SIGMA,
                         "out_range": [OUT_MIN, OUT_MAX]},
            "admission_extra": args.admission_extra, "placement": placement,
            "sim_cmd": sim_argv, "gateway_cmd": gw_argv,
            "host": {"cpus": os.cpu_count(), "allowed_cpus": allowed, "cpu_model": cpu_model(),
                     "loadavg_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
                     "python": platform.python_version()},
        },
        "points": [],
    }

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_signal)

    ok = False
    t_start = time.monotonic()
    try:
        print(f"placement: gateways {placement['gateway']}, sim {placement['sim']}, load "
              f"generator {placement['client']}; logs in {tmp}", flush=True)
        procs.start("sim", sim_argv, sim_cpus)
        wait_http(procs, "sim", f"{sim_base}/v1/models")
        for mode in MODES:
            procs.start(mode, gw_argv[mode], gw_cpus)
        for mode in MODES:
            wait_http(procs, mode, f"{urls[mode]}/healthz")
            for cls in CLASSES:
                status, n = probe_stream(f"{urls[mode]}/v1/chat/completions", cls)
                if status != 200 or n != 4:
                    raise RuntimeError(f"probe via the {mode} gateway ({cls}): HTTP {status}, "
                                       f"{n} tokens (expected 200 and 4); logs in {tmp}")

        derived = derived_capacity(sim_knobs)
        cap: dict[str, Any] = {"derived": derived}
        if args.capacity:
            cap.update(used_rps=args.capacity, source="given with --capacity")
        else:
            print(f"capacity: closed loop, {args.max_batch} workers straight to the sim, "
                  f"{cap_window:g} s …", end=" ", flush=True)
            spec = {"mode": "closed", "url": f"{sim_base}/v1/chat/completions", "slo": slo,
                    "classes": CLASSES, "workers": args.max_batch, "warmup": 1.0,
                    "count_from": 1.0, "count_to": 1.0 + cap_window,
                    "window": cap_window, "seed": args.seed, "no_probes": True,
                    "sim_stats_url": f"{sim_base}/sim/stats"}
            r = run_client(procs, tmp, "capacity", spec, client_cpus)
            recs = [x for x in r["records"] if x["status"] == 200 and "t_last" in x
                    and x["t_send"] >= 1.0]
            ttft = [x["t_first"] - x["t_send"] for x in recs]
            tpot = [(x["t_last"] - x["t_first"]) / (x["n"] - 1) for x in recs if x["n"] > 1]
            rps = r["work_in_window"] / r["window_s"]
            cap["measured"] = {"rps": rps, "workers": args.max_batch, "window_s": cap_window,
                               "completed": r["completed_in_window"],
                               "completed_rps": r["completed_in_window"] / r["window_s"],
                               "ttft_p99_ms": (_pct(ttft, 99) or 0) * 1e3,
                               "ttft_p50_ms": (_pct(ttft, 50) or 0) * 1e3,
                               "tpot_p99_ms": (_pct(tpot, 99) or 0) * 1e3,
                               "tpot_p50_ms": (_pct(tpot, 50) or 0) * 1e3}
            cm = cap["measured"]
            slo_ok = (cm["ttft_p99_ms"] <= CLASSES["interactive"][0]
                      and cm["tpot_p99_ms"] <= CLASSES["interactive"][1])
            cap.update(used_rps=rps, source="measured: closed loop at full batch",
                       interactive_slo_met_at_capacity=slo_ok)
            print(f"{rps:.2f} req/s (derived {derived['req_per_s']:.2f}); TTFT p99 "
                  f"{cm['ttft_p99_ms']:.0f} ms, TPOT p99 {cm['tpot_p99_ms']:.1f} ms"
                  + ("" if slo_ok else " — the interactive SLO does NOT hold at this rate"),
                  flush=True)
            wait_quiet(f"{sim_base}/sim/stats", None)
        results["capacity"] = cap
        capacity = cap["used_rps"]

        def spec_for(mode: str, rate: float, seed: int) -> dict[str, Any]:
            return {"mode": "open", "url": f"{urls[mode]}/v1/chat/completions",
                    "warmup": warmup, "window": window, "tail_cap": tail_cap,
                    "schedule": make_schedule(rate, [warmup, window, tail_cap], seed,
                                              args.probe_fraction, CLASSES),
                    "admin_url": f"{urls[mode]}/admin/admission" if mode == "admission" else None,
                    "sim_stats_url": f"{sim_base}/sim/stats"}

        for k, load in enumerate(loads):
            point: dict[str, Any] = {"load": load, "rate_rps": load * capacity}
            for mode in modes:
                print(f"[{load:g}× = {load * capacity:.2f} req/s] {mode:<11} …", end=" ",
                      flush=True)
                admin = f"{urls[mode]}/admin/admission" if mode == "admission" else None
                before = scrape_metrics(f"{urls[mode]}/metrics")
                spec = spec_for(mode, load * capacity, args.seed + k)
                r = run_client(procs, tmp, f"{mode}-{load:g}", spec, client_cpus)
                after = scrape_metrics(f"{urls[mode]}/metrics")
                s = summarize(r, warmup, window, slo)
                s["gateway"] = metrics_delta(before, after)
                if admin:
                    s["admin_end_of_window"] = r.get("admin_end_of_window")
                s["quiet_after"] = wait_quiet(f"{sim_base}/sim/stats", admin)
                if args.raw:
                    s["records"] = r["records"]
                    s["samples"] = r["samples"]
                point[mode] = s
                ci = s["classes"]["interactive"]
                print(f"goodput {s['goodput_rps']:.2f} req/s (int {ci['goodput_rps']:.2f}, batch "
                      f"{s['classes']['batch']['goodput_rps']:.2f}), rejected "
                      f"{pct(s['classes']['all']['rejection_rate'])}, int TTFT p99 "
                      f"{fmt(ci['ttft_ms']['p99'])} ms, retry admitted "
                      f"{pct(s['classes']['all']['retry_probes']['admitted_rate'])}", flush=True)
            results["points"].append(point)
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
    results["meta"]["elapsed_s"] = time.monotonic() - t_start
    if set(modes) == set(MODES):
        results["verdict"] = verdict(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    if set(modes) != set(MODES):
        print(f"\nresults: {out} (table and plot need both modes)")
        return 0
    table = render(results)
    print()
    print(table)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(table + "\n")
    note = plot(results, Path(args.plot)) if args.plot else "no plot asked for"
    print(f"\nresults: {out}" + (f", {args.markdown}" if args.markdown else "")
          + (f", {args.plot}" if note is None else f" ({note})")
          + f"; {results['meta']['elapsed_s']:.0f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# Fairness runs (issue 11): admission on, max_concurrency left at its default (256), so the
# adaptive concurrency limit must find the engine's batch by itself.
# ---------------------------------------------------------------------------------------------

FAIR_SCENARIOS: dict[str, dict[str, Any]] = {
    # name: classes {name: (TTFT ms, TPOT ms, priority, share of traffic)}, extra class TOML,
    # tenants {class: (key, weight, quota TOML)}, load (x capacity), runs
    "equal": {
        "title": "two classes, equal priority and weight, 2x capacity",
        "classes": {"interactive": (1000.0, 50.0, 0, 0.5), "batch": (30000.0, 200.0, 0, 0.5)},
        "load": 2.0},
    "priority": {
        "title": "priority 10 vs 0, min_share 0.2, 2x capacity",
        "classes": {"interactive": (1000.0, 50.0, 10, 0.7), "batch": (30000.0, 200.0, 0, 0.3)},
        "min_share": {"interactive": 0.05, "batch": 0.2},
        "load": 2.0},
    "quota": {
        "title": "tenant A at 10x its quota beside tenant B",
        # A's quota is 0.25 x capacity in requests per minute; it offers 2.5 x capacity.
        # B offers 0.5 x capacity; measured alone first, then beside A.
        "classes": {"a": (1000.0, 50.0, 0, 2.5 / 3.0), "b": (1000.0, 50.0, 0, 0.5 / 3.0)},
        "alone": {"b": (1000.0, 50.0, 0, 1.0)},
        "quota_a_x_capacity": 0.25,
        "load": 3.0, "alone_load": 0.5},
}


# The fairness matrix (--matrix): short runs over the SLO mixes admission must be fair for.
# The engine is the simulator with max batch 8 (TTFT ~70 ms unloaded for the benchmark's
# prompts, TPOT ~17 ms); TTFT targets are multiples of UNLOADED_TTFT_MS. "tenants": one key
# (tenant) per class, so the two classes are two tenants of the same targets.
UNLOADED_TTFT_MS = 70.0
ISSUE_CLASSES: dict[str, SloClass] = {"interactive": (280.0, 42.0, 0, 0.5),
                                      "batch": (3000.0, 85.0, 0, 0.5)}
MATRIX_CELLS: dict[str, dict[str, Any]] = {
    "2cls-4x-2.0": {"classes": ISSUE_CLASSES, "load": 2.0},
    "2cls-2x-2.0": {"classes": {"interactive": (140.0, 42.0, 0, 0.5),
                                "batch": (3000.0, 85.0, 0, 0.5)}, "load": 2.0},
    "2cls-20x-2.0": {"classes": {"interactive": (1400.0, 42.0, 0, 0.5),
                                 "batch": (3000.0, 85.0, 0, 0.5)}, "load": 2.0},
    "2cls-4x-1.2": {"classes": ISSUE_CLASSES, "load": 1.2},
    "2cls-4x-3.0": {"classes": ISSUE_CLASSES, "load": 3.0},
    "2cls-4x-w3:1": {"classes": ISSUE_CLASSES, "load": 2.0,
                     "weights": {"interactive": 3.0, "batch": 1.0}},
    "2cls-4x-w1:3": {"classes": ISSUE_CLASSES, "load": 2.0,
                     "weights": {"interactive": 1.0, "batch": 3.0}},
    "3cls-2/10/40x-2.0": {"classes": {"fast": (140.0, 42.0, 0, 1 / 3),
                                      "mid": (700.0, 60.0, 0, 1 / 3),
                                      "slow": (2800.0, 85.0, 0, 1 / 3)}, "load": 2.0},
    "3cls-w2:1:1-3.0": {"classes": {"fast": (280.0, 42.0, 0, 1 / 3),
                                    "mid": (700.0, 60.0, 0, 1 / 3),
                                    "slow": (2800.0, 85.0, 0, 1 / 3)}, "load": 3.0,
                        "weights": {"fast": 2.0, "mid": 1.0, "slow": 1.0}},
    "flood-a2.5/b0.5": {"classes": {"a": (280.0, 42.0, 0, 2.5 / 3.0),
                                    "b": (280.0, 42.0, 0, 0.5 / 3.0)}, "load": 3.0,
                        "tenants": True},
}
STARVE_WINDOW_S = 10.0


def met_by_window(run: dict[str, Any], warmup: float, window: float, slo: SloTargets,
                  step: float = STARVE_WINDOW_S) -> dict[str, list[int]]:
    """Per class: requests that finished meeting their SLO in each `step` s of the window."""
    n = max(1, int(window // step))
    out = {c: [0] * n for c in slo}
    for r in run["records"]:
        t = r.get("t_end")
        if r["probe_of"] is not None or t is None or not warmup <= t < warmup + n * step:
            continue
        if judge(r, slo)["met"]:
            out[r["cls"]][int((t - warmup) // step)] += 1
    return out


def fairness_toml(host: str, port: int, sim_port: int, classes: dict[str, SloClass],
                  min_share: dict[str, float], quota_a_rpm: int | None,
                  weights: Mapping[str, float] | None = None, tenants: bool = False) -> str:
    out = (f'[server]\nhost = "{host}"\nport = {port}\naccess_log = false\n\n'
           '[admission]\nenabled = true\n\n')
    out += f'[slo]\ndefault = "{next(iter(classes))}"\n'
    for name, (ttft, tpot, prio, _) in classes.items():
        out += (f'\n[[slo_classes]]\nname = "{name}"\nttft_ms = {ttft:g}\ntpot_ms = {tpot:g}\n'
                f"priority = {prio}\n")
        if name in min_share:
            out += f"min_share = {min_share[name]:g}\n"
        if weights and name in weights:
            out += f"weight = {weights[name]:g}\n"
    names = ", ".join(f'"{n}"' for n in classes)
    out += '\n[auth]\nmode = "keys"\n'
    import hashlib
    admin = hashlib.sha256(b"bench-admin").hexdigest()
    out += f'\n[[auth.admin_keys]]\nname = "bench"\nsha256 = "{admin}"\n'
    if quota_a_rpm is None and not tenants:
        digest = hashlib.sha256(b"bench").hexdigest()
        out += (f'\n[[auth.keys]]\ntenant = "bench"\nsha256 = "{digest}"\n'
                f"classes = [{names}]\n")
    else:
        for name in classes:
            digest = hashlib.sha256(f"key-{name}".encode()).hexdigest()
            out += (f'\n[[auth.keys]]\ntenant = "tenant-{name}"\nsha256 = "{digest}"\n'
                    f'classes = ["{name}"]\n')
            if name == "a" and quota_a_rpm is not None:
                out += f"requests_per_minute = {quota_a_rpm}\n"
    out += (f'\n[[backends]]\nname = "sim"\ntype = "openai"\n'
            f'base_url = "http://{host}:{sim_port}/v1"\nmodels = ["*"]\n'
            'forward_headers = ["x-sim-*"]\n'
            # the simulator continues a final assistant message, as vLLM and SGLang do: a
            # preempted stream goes on there (admission.preemption)
            'continuation = "prefill"\n')
    return out


def save_decisions(url: str, path: Path) -> None:
    """The gateway's decision ring, oldest first, one JSON object per line."""
    req = urllib.request.Request(f"{url}/admin/decisions?limit={MAX_QUERY}",
                                 headers={"Authorization": "Bearer bench-admin"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        records = json.loads(resp.read())
    rows = records.get("decisions", records) if isinstance(records, dict) else records
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))


def fairness_main(args: argparse.Namespace) -> int:
    """Capacity (closed loop straight to the sim), then each scenario (or, with --matrix, each
    cell of the matrix) against a fresh gateway with admission's default config. Prints a
    markdown table; writes JSON."""
    matrix = bool(getattr(args, "matrix", False))
    scenarios = MATRIX_CELLS if matrix else FAIR_SCENARIOS
    window = args.window or (8.0 if args.quick else 20.0 if matrix else 15.0)
    warmup = args.warmup if args.warmup is not None else (3.0 if args.quick else
                                                          4.0 if matrix else 5.0)
    cap_window = args.capacity_window or (4.0 if args.quick else 10.0)
    allowed = sorted(os.sched_getaffinity(0))
    two = len(allowed) >= 2
    gw_cpus = parse_cpus(args.gateway_cpu, allowed, allowed[1] if two else None)
    sim_cpus = parse_cpus(args.sim_cpu, allowed, allowed[0] if two else None)
    client_cpus = parse_cpus(args.client_cpu, allowed, None) if args.client_cpu else sim_cpus
    tmp = Path(tempfile.mkdtemp(prefix="slogate-fairness-"))
    procs = BenchProcs(tmp)
    host = args.host
    sim_knobs = {"max_batch": args.max_batch, "decode_base_ms": args.decode_base_ms,
                 "decode_per_seq_ms": args.decode_per_seq_ms,
                 "prefill_tokens_per_s": args.prefill_tokens_per_s,
                 "prefill_chunk_tokens": args.prefill_chunk_tokens}
    sim_port = free_port(host)
    subst = {"python": shlex.quote(sys.executable), "host": host,
             **{k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in sim_knobs.items()}}
    sim_argv = shlex.split(args.sim_cmd.format(**subst, port=sim_port))
    sim_base = f"http://{host}:{sim_port}"
    results: dict[str, Any] = {"meta": {
        "benchmark": "fairness-matrix" if matrix else "fairness", "git": git_rev(),
        "window_s": window, "warmup_s": warmup,
        "sim": sim_knobs, "seed": args.seed,
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "cpu_model": cpu_model(),
                 "loadavg_start": " ".join(Path("/proc/loadavg").read_text().split()[:3])}},
        "runs": {}}
    ok = False
    try:
        procs.start("sim", sim_argv, sim_cpus)
        wait_http(procs, "sim", f"{sim_base}/v1/models")
        if args.capacity:
            capacity = args.capacity
        else:
            spec = {"mode": "closed", "url": f"{sim_base}/v1/chat/completions",
                    "slo": {n: (v[0], v[1]) for n, v in CLASSES.items()}, "classes": CLASSES,
                    "workers": args.max_batch, "warmup": 1.0, "count_from": 1.0,
                    "count_to": 1.0 + cap_window, "window": cap_window, "seed": args.seed,
                    "no_probes": True}
            r = run_client(procs, tmp, "capacity", spec, client_cpus)
            capacity = r["work_in_window"] / r["window_s"]
            wait_quiet(f"{sim_base}/sim/stats", None)
        results["capacity_rps"] = capacity
        print(f"capacity {capacity:.2f} req/s (closed loop, batch {args.max_batch})", flush=True)
        runs: list[tuple[str, str, dict[str, SloClass], float]] = []
        only = set(os.environ.get("BENCH_FAIR_SCENARIOS", ",".join(scenarios)).split(","))
        for name, sc in scenarios.items():
            if name not in only:
                continue
            if name == "quota":
                runs.append((name, "b alone", sc["alone"], sc["alone_load"]))
            runs.append((name, "", sc["classes"], sc["load"]))
        for k, (name, variant, classes, load) in enumerate(runs):
            sc = scenarios[name]
            port = free_port(host)
            quota = (max(1, round(sc["quota_a_x_capacity"] * capacity * 60))
                     if name == "quota" else None)
            safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
            cfg = tmp / f"gateway-{safe}-{k}.toml"
            cfg.write_text(fairness_toml(host, port, sim_port, sc["classes"],
                                         sc.get("min_share", {}), quota, sc.get("weights"),
                                         bool(sc.get("tenants"))))
            tag = f"gw-{safe}-{k}"
            procs.WATCHED = (*BenchProcs.WATCHED, tag)
            p = procs.start(tag, shlex.split(args.gateway_cmd.format(
                **subst, config=str(cfg), port=port)), gw_cpus)
            url = f"http://{host}:{port}"
            wait_http(procs, tag, f"{url}/healthz")
            keys = ({c: f"key-{c}" for c in classes} if name == "quota" or sc.get("tenants")
                    else {})
            slo = {n: (v[0], v[1]) for n, v in classes.items()}
            # A's bucket holds a minute of its quota (OpenAI's and Anthropic's semantics: a
            # full minute may come as a burst): the warm-up spends that burst first.
            warm = max(warmup, 30.0 if args.quick else 45.0) if name == "quota" else warmup
            spec = {"mode": "open", "url": f"{url}/v1/chat/completions", "warmup": warm,
                    "window": window, "tail_cap": 0.0, "keys": keys,
                    "schedule": make_schedule(load * capacity, [warm, window, 0.0],
                                              args.seed + k, 0.0, classes),
                    "sim_stats_url": f"{sim_base}/sim/stats",
                    "admin_url": f"{url}/admin/admission", "poll_s": 0.25,
                    "admin_headers": {"Authorization": "Bearer bench-admin"}}
            label = f"{name}{' (' + variant + ')' if variant else ''}"
            print(f"{label}: {load:g}x capacity …", end=" ", flush=True)
            r = run_client(procs, tmp, f"fair-{safe}-{k}", spec, client_cpus)
            summary = summarize(r, warm, window, slo)
            summary["met_by_window"] = met_by_window(r, warm, window, slo)
            with contextlib.suppress(Exception):
                req = urllib.request.Request(f"{url}/admin/admission",
                                             headers={"Authorization": "Bearer bench-admin"})
                with urllib.request.urlopen(req, timeout=5) as resp:
                    summary["admission_end"] = json.loads(resp.read())
            if args.decisions is not None:  # the flight recorder's ring, for a post-mortem
                save_decisions(url, args.decisions / f"{safe}.jsonl")
                # ... and what admission and the engine held, every 250 ms
                with (args.decisions / f"{safe}.timeline.jsonl").open("w") as f:
                    f.writelines(json.dumps(x) + "\n" for x in r.get("samples", []))
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=40)
            wait_quiet(f"{sim_base}/sim/stats", None)
            results["runs"][label] = {"load": load, "summary": summary, "quota_a_rpm": quota,
                                      "classes": classes, "weights": sc.get("weights", {})}
            print(", ".join(f"{c} goodput {summary['classes'][c]['goodput_rps']:.2f} req/s"
                            for c in classes), flush=True)
        ok = True
    except RuntimeError as e:
        print(f"\nbenchmark failed: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        if ok and not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not ok:
            print(f"process logs kept in {tmp}", file=sys.stderr)
    table = render_matrix(results) if matrix else render_fairness(results)
    print()
    print(table)
    stem = "fairness-matrix" if matrix else "fairness"
    out = Path(args.out.replace("goodput.json", f"{stem}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    md = Path(args.markdown.replace("goodput.md", f"{stem}.md"))
    md.write_text(table + "\n")
    print(f"\nresults: {out}, {md}")
    return 0


def render_fairness(results: dict[str, Any]) -> str:
    cap = results["capacity_rps"]
    runs = results["runs"]
    rows = ["| run | class / tenant | goodput req/s | share of capacity | TTFT p99 ms (admitted) "
            "| rejected | criterion | met? |", "|---|---|---|---|---|---|---|---|"]

    def g(label: str, cls: str) -> dict[str, Any]:
        return dict(runs[label]["summary"]["classes"][cls])

    eq = "equal"
    if eq in runs:
        tot = runs[eq]["summary"]["goodput_rps"]
        for cls in ("interactive", "batch"):
            c = g(eq, cls)
            share = c["goodput_rps"] / cap
            rows.append(f"| equal, 2x | {cls} | {c['goodput_rps']:.2f} | {share:.0%} | "
                        f"{fmt(c['ttft_ms']['p99'])} | {pct(c['rejection_rate'])} | >= 40 % "
                        f"| {'yes' if share >= 0.4 else 'no'} |")
        rows.append(f"| equal, 2x | total | {tot:.2f} | {tot / cap:.0%} | | | >= 90 % of peak "
                    f"| {'yes' if tot / cap >= 0.9 else 'no'} |")
    pr = "priority"
    if pr in runs:
        hi, lo = g(pr, "interactive"), g(pr, "batch")
        lo_share = lo["goodput_rps"] / cap
        p99 = hi["ttft_ms"]["p99"]
        rows.append(f"| priority 10/0, min_share 0.2, 2x | batch (low) | {lo['goodput_rps']:.2f} "
                    f"| {lo_share:.0%} | {fmt(lo['ttft_ms']['p99'])} | "
                    f"{pct(lo['rejection_rate'])} | >= 15 % | "
                    f"{'yes' if lo_share >= 0.15 else 'no'} |")
        rows.append(f"| priority 10/0, min_share 0.2, 2x | interactive (high) | "
                    f"{hi['goodput_rps']:.2f} | {hi['goodput_rps'] / cap:.0%} | {fmt(p99)} | "
                    f"{pct(hi['rejection_rate'])} | P99 TTFT <= 1000 ms | "
                    f"{'yes' if p99 is not None and p99 <= 1000 else 'no'} |")
    alone, both = "quota (b alone)", "quota"
    if alone in runs and both in runs:
        b0 = g(alone, "b")["goodput_rps"]
        b1, a1 = g(both, "b"), g(both, "a")
        ratio = b1["goodput_rps"] / b0 if b0 else 0.0
        rows.append(f"| quota: B alone, 0.5x | tenant B | {b0:.2f} | {b0 / cap:.0%} | "
                    f"{fmt(g(alone, 'b')['ttft_ms']['p99'])} | "
                    f"{pct(g(alone, 'b')['rejection_rate'])} | | |")
        rows.append(f"| quota: A at 10x its quota | tenant A | {a1['goodput_rps']:.2f} | "
                    f"{a1['goodput_rps'] / cap:.0%} | {fmt(a1['ttft_ms']['p99'])} | "
                    f"{pct(a1['rejection_rate'])} | | |")
        rows.append(f"| quota: A at 10x its quota | tenant B | {b1['goodput_rps']:.2f} | "
                    f"{b1['goodput_rps'] / cap:.0%} | {fmt(b1['ttft_ms']['p99'])} | "
                    f"{pct(b1['rejection_rate'])} | >= 90 % of alone ({ratio:.0%}) | "
                    f"{'yes' if ratio >= 0.9 else 'no'} |")
    m = results["meta"]
    head = (f"Fairness (admission defaults: max_concurrency 256, adaptive limit), capacity "
            f"{cap:.2f} req/s (sim batch {m['sim']['max_batch']}), warm-up {m['warmup_s']:g} s "
            f"+ window {m['window_s']:g} s, host load at start {m['host']['loadavg_start']}")
    return head + "\n\n" + "\n".join(rows)


def judge_cell(run: dict[str, Any], capacity: float, window_s: float) -> dict[str, Any]:
    """A matrix cell's criteria: every class with demand gets >= 80 % of its weighted fair
    share of capacity as goodput, the total >= 90 % of the peak (capacity, or the demand when
    less), and no class has a STARVE_WINDOW_S window without goodput. The demand is what
    each class offered in the window (its arrivals): each arrival's class is drawn from the
    mix, so a short window's split strays from the mix's by several per cent, and a class
    that asked for less than its share is owed what it asked for."""
    classes: dict[str, Sequence[float]] = run["classes"]
    weights = {c: float(run.get("weights", {}).get(c, 1.0)) for c in classes}
    s = run["summary"]
    demand = {c: s["classes"][c]["arrived"] / window_s for c in classes}
    fair = fair_shares(demand, weights, capacity)
    rows = {}
    for c in classes:
        got = s["classes"][c]["goodput_rps"]
        windows = s["met_by_window"][c]
        rows[c] = {"goodput_rps": got, "fair_rps": fair[c], "of_fair": got / fair[c],
                   "fair_ok": got >= 0.8 * fair[c], "starved": min(windows) == 0,
                   "rejected": s["classes"][c]["rejected"],
                   "reject_reasons": s["classes"][c]["reject_reasons"],
                   "ttft_p99_ms": s["classes"][c]["ttft_ms"]["p99"]}
    peak = min(capacity, sum(demand.values()))
    total = s["goodput_rps"]
    ok = (all(r["fair_ok"] and not r["starved"] for r in rows.values())
          and total >= 0.9 * peak)
    return {"classes": rows, "total_rps": total, "of_peak": total / peak, "ok": ok}


def render_matrix(results: dict[str, Any]) -> str:
    cap = results["capacity_rps"]
    rows = ["| cell | load | class: goodput / fair share (% of fair), rejected | total "
            "(% of peak) | starved | met? |", "|---|---|---|---|---|---|"]
    passed = 0
    for label, run in results["runs"].items():
        j = judge_cell(run, cap, results["meta"]["window_s"])
        passed += j["ok"]
        per = "; ".join(f"{c}: {r['goodput_rps']:.2f}/{r['fair_rps']:.2f} ({r['of_fair']:.0%}), "
                        f"{r['rejected']}" for c, r in j["classes"].items())
        starved = ", ".join(c for c, r in j["classes"].items() if r["starved"]) or "-"
        rows.append(f"| {label} | {run['load']:g}x | {per} | {j['total_rps']:.2f} "
                    f"({j['of_peak']:.0%}) | {starved} | {'yes' if j['ok'] else 'no'} |")
    m = results["meta"]
    head = (f"Fairness matrix: {passed}/{len(results['runs'])} cells meet the criteria (each "
            f"class >= 80 % of its weighted fair share, total >= 90 % of peak, no "
            f"{STARVE_WINDOW_S:g} s window without goodput). Capacity {cap:.2f} req/s (sim batch "
            f"{m['sim']['max_batch']}), warm-up {m['warmup_s']:g} s + window {m['window_s']:g} s, "
            f"git {m['git']}, host load at start {m['host']['loadavg_start']}")
    return head + "\n\n" + "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
