"""The console's recorder and endpoints, without a browser (tests/system/test_console_browser.py
drives the page in chromium).

Proves: percentiles from the log histograms are within their stated error of exact ones;
memory stays bounded at 1,000 requests/s (fixed slots, bounded heaps, a sampled ring); the
waterfall's stages put a pre-first-token stall in `first_token`, take provider-reported queue
and prefill out of it, and invent nothing when the provider reports nothing; the gateway serves
the page, its assets and a pushed snapshot at least once a second, and the snapshot says who
is in flight on which backend.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from types import SimpleNamespace

import aiohttp
import orjson

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.console.recorder import _BINS, ConsoleRecorder, _bin, percentiles, stages
from gateway.ops.server import build_app
from gateway.request.slo import SLOClass
from tests.support.servers import serve_app

MS = 1_000_000
CLASSES = [SLOClass("interactive", 500, 50), SLOClass("batch", 20000, 200)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fake_ctx(i: int = 0, *, ttft_ms: float = 100, decode_ms: float = 200, tokens: int = 21,
             cls: str = "interactive", verdict: str = "met", queue_s=None, prefill_s=None,
             connect_ms: float = 0.0, gateway_ms: float = 1.0) -> SimpleNamespace:
    t0 = 10_000 * MS
    sent = t0 + int(gateway_ms * MS)
    first = t0 + int(ttft_ms * MS)
    last = first + int(decode_ms * MS)
    return SimpleNamespace(
        request_id=f"req-{i}", trace=SimpleNamespace(trace_id=f"{i:032x}"),
        slo=SimpleNamespace(name=cls), verdict=verdict, outcome="ok", status=200,
        backend="sim", model_label="m", route="/v1/chat/completions", tenant=None,
        hedge=None, continued_from=(),
        t_received=t0, t_dispatched=sent, t_sent=sent,
        t_connect_start=sent if connect_ms else 0,
        t_connect_end=sent + int(connect_ms * MS) if connect_ms else 0,
        t_first_token=first, t_last_token=last, t_end=last + MS, completion_tokens=tokens,
        provider_queue_s=queue_s, provider_prefill_s=prefill_s)


def test_percentiles_are_within_the_histograms_error() -> None:
    rng = random.Random(1)
    values = [rng.lognormvariate(4, 1.2) for _ in range(20_000)]
    hist = [0] * _BINS
    for v in values:
        hist[_bin(v)] += 1
    exact = sorted(values)
    for q, got in zip((0.5, 0.9, 0.99), percentiles(hist, len(values), (0.5, 0.9, 0.99)),
                      strict=True):
        want = exact[int(q * len(exact)) - 1]
        assert abs(got - want) / want < 0.05, (q, got, want)
    assert percentiles([0] * _BINS, 0, (0.5,)) == [None]


def test_memory_is_bounded_at_a_thousand_requests_a_second() -> None:
    clock = Clock()
    rec = ConsoleRecorder(CLASSES, clock=clock)
    rng = random.Random(2)
    for i in range(120_000):  # two minutes at 1,000/s
        clock.t += 0.001
        rec.record(fake_ctx(i, ttft_ms=rng.uniform(20, 400), cls=rng.choice(["interactive",
                                                                             "batch"])))
    assert rec.total == 120_000
    assert set(rec._slots) == {"interactive", "batch"}
    assert all(len(ring) == rec.nslots for ring in rec._slots.values())
    assert all(len(e[1]) <= rec.slow_keep for e in rec._slow if e is not None)
    assert len(rec.recent) == 200
    # Recent rows are sampled to about 50 a second: the ring's 200 rows span ~4 s, not 0.2 s.
    ats = [r["at"] for r in rec.recent if r is not None]
    assert 3.0 < max(ats) - min(ats) < 6.0
    snap = rec.snapshot()
    ages = [r["ago_s"] for r in snap["recent"]]
    assert ages == sorted(ages) and len(ages) == 50
    assert len(snap["slowest"]) == rec.slow_keep
    assert 900 < snap["rate_rps"] < 1100
    inter = snap["classes"]["interactive"]
    assert inter["requests"] + snap["classes"]["batch"]["requests"] == 120_000
    assert 180 < inter["ttft_ms"]["p50"] < 230 and inter["goodput"] == 1.0


def test_window_forgets_old_requests_and_counts_goodput_and_budget() -> None:
    clock = Clock()
    rec = ConsoleRecorder(CLASSES, clock=clock)
    for i in range(99):
        rec.record(fake_ctx(i))
    rec.record(fake_ctx(99, ttft_ms=900, verdict="ttft_missed"))
    c = rec.snapshot()["classes"]["interactive"]
    assert (c["judged"], c["met"], c["goodput"]) == (100, 99, 0.99)
    assert c["budget_left"] == 0.0 and c["burn_rate"] == 1.0  # exactly at the objective
    clock.t += 301  # past the 5-minute window
    snap = rec.snapshot()
    assert snap["classes"]["interactive"]["requests"] == 0 and snap["slowest"] == []
    assert snap["classes"]["batch"]["target"] == {"ttft_ms": 20000, "tpot_ms": 200}


def test_requests_refused_before_a_class_are_a_count_not_a_class() -> None:
    """A bad key, body or route is refused before the request has an SLO class: the console
    counts them, and shows no class card (no class "none", no empty charts) for them."""
    clock = Clock()
    rec = ConsoleRecorder(CLASSES, clock=clock)
    rec.record(fake_ctx(0))
    for i in range(3):
        refused = fake_ctx(i + 1, verdict=None)
        refused.slo, refused.outcome, refused.status = None, "rejected", 401
        rec.record(refused)
    snap = rec.snapshot()
    assert set(snap["classes"]) == {"interactive", "batch"}
    assert snap["refused_unclassified"] == 3
    clock.t += 301
    assert rec.snapshot()["refused_unclassified"] == 0  # the window forgets them too


def test_stages_put_a_stall_before_the_first_token_in_first_token() -> None:
    # Groq-style timings: queue and prefill come out of the wait, the rest is the stall.
    ctx = fake_ctx(ttft_ms=1600, queue_s=0.02, prefill_s=0.05, connect_ms=3, gateway_ms=1)
    got = {s["stage"]: s for s in stages(ctx)}
    assert list(got) == ["gateway_queue", "connect", "engine_queue", "prefill", "first_token",
                         "decode"]
    assert got["engine_queue"]["source"] == got["prefill"]["source"] == "provider"
    assert abs(got["first_token"]["ms"] - (1600 - 1 - 3 - 20 - 50)) < 0.01
    assert got["decode"]["start_ms"] == 1600 and got["decode"]["ms"] == 200
    # Stages follow each other on the timeline.
    order = [got[k] for k in ("connect", "engine_queue", "prefill", "first_token")]
    for a, b in itertools.pairwise(order):
        assert abs(a["start_ms"] + a["ms"] - b["start_ms"]) < 0.01
    # Nothing reported: no queue or prefill is invented; the whole wait is first_token.
    plain = {s["stage"] for s in stages(fake_ctx(ttft_ms=300))}
    assert plain == {"gateway_queue", "first_token", "decode"}
    # Refused before any upstream work: only the gateway's own time.
    refused = SimpleNamespace(**{**vars(fake_ctx()), "t_sent": 0, "t_dispatched": 0,
                                 "t_first_token": 0, "t_last_token": 0})
    assert [s["stage"] for s in stages(refused)] == ["gateway_queue"]


async def test_console_page_assets_and_pushed_snapshots() -> None:
    async with serve_app(build_sim(SimConfig(decode_base_ms=2,
                                             served_model_names=["m"]))) as sim_url:
        cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": False},
                            "backends": [{"name": "sim", "base_url": sim_url + "/v1",
                                          "models": ["m"], "forward_headers": ["x-sim-*"]}]},
                            env={})
        async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
            async with s.get(gw + "/console") as r:
                page = await r.text()
                assert r.status == 200 and r.content_type == "text/html"
            assert "/console/static/console.js" in page and "http" not in page.replace(
                "http://www.w3.org", "")  # no CDN
            for name, ctype in (("console.js", "application/javascript"),
                                ("console.css", "text/css")):
                async with s.get(f"{gw}/console/static/{name}") as r:
                    assert r.status == 200 and r.content_type == ctype
            async with s.get(gw + "/console/static/..%2Fweb.py") as r:
                assert r.status == 404
            async with s.get(gw + "/console/state") as r:
                empty = await r.json()
            assert empty["requests_total"] == 0 and empty["models"] == ["m"]
            assert empty["backends"][0]["breaker"] == "closed"

            # A request in flight shows on its backend; then it is counted.
            body = {"model": "m", "stream": True, "max_tokens": 40,
                    "messages": [{"role": "user", "content": "hi"}]}
            slow = asyncio.create_task(s.post(gw + "/v1/chat/completions", json=body,
                                              headers={"x-sim-token-delay-ms": "25"}))
            deadline = time.monotonic() + 10
            while True:
                async with s.get(gw + "/console/state") as r:
                    state = await r.json()
                if state["backends"][0]["in_flight"] == 1:
                    break
                assert time.monotonic() < deadline, state["backends"]
                await asyncio.sleep(0.02)
            resp = await slow
            await resp.read()
            resp.release()

            t0 = time.monotonic()
            seen = []
            async with s.get(gw + "/console/events") as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    if line.startswith(b"data: "):
                        seen.append(orjson.loads(line[6:]))
                        if len(seen) == 3:
                            break
            assert time.monotonic() - t0 < 3.5  # at least once a second
            assert seen[-1]["requests_total"] == 1
            assert seen[-1]["slowest"][0]["stages"][-1]["stage"] == "decode"


async def test_snapshot_shows_the_admission_queue_and_predicted_ttft() -> None:
    async with serve_app(build_sim(SimConfig(decode_base_ms=2))) as sim_url:
        cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": False},
                            "admission": {"enabled": True, "max_concurrency": 1},
                            "backends": [{"name": "sim", "base_url": sim_url + "/v1",
                                          "models": ["m"], "forward_headers": ["x-sim-*"]}]},
                            env={})
        async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
            body = {"model": "m", "stream": True, "max_tokens": 30,
                    "messages": [{"role": "user", "content": "hi"}]}
            posts = [asyncio.create_task(s.post(gw + "/v1/chat/completions", json=body,
                                                headers={"x-sim-token-delay-ms": "20"}))
                     for _ in range(4)]
            deadline = time.monotonic() + 10
            while True:  # one admitted (the cap), three waiting for admission
                async with s.get(gw + "/console/state") as r:
                    state = await r.json()
                if state["admission"]["queued"] == 3:
                    break
                assert time.monotonic() < deadline, state["admission"]
                await asyncio.sleep(0.02)
            for p in posts:
                resp = await p
                await resp.read()
    assert state["admission"]["enabled"] and state["admission"]["by_class"] == {"default": 3}
    assert state["admission"]["by_tenant"] == {"(no key)": 3}
    sim = state["backends"][0]
    assert sim["in_flight"] == 1 and sim["predicted_ttft_ms"] > 0 and sim["cap"] == 1
