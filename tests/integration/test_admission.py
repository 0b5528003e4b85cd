"""SLO-aware admission control against the simulator (whose physics the estimators learn)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import random

import aiohttp
import orjson
import pytest

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.admission.estimator import RLS, ReplicaEstimator
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.upstreams import REQUESTS, scripted_app
from tests.support.waiting import wait_until

MSG = "word " * 10


def gw(backends: list[tuple[str, str]], admission: dict | None = None, **extra) -> config.Config:
    raw = {"auth": {"mode": "open"}, "server": {"access_log": False},
           "admission": {"enabled": True, **(admission or {})},
           "slo_classes": [{"name": "interactive", "ttft_ms": 400, "tpot_ms": 60, "priority": 10},
                           {"name": "batch", "ttft_ms": 60_000, "tpot_ms": 1000, "priority": 0},
                           {"name": "relaxed", "ttft_ms": 60_000, "tpot_ms": 60_000}],
           "slo": {"default": "relaxed"},
           "backends": [{"name": n, "base_url": u + "/v1", "models": ["m"]} for n, u in backends]}
    raw.update(extra)
    return config.parse(raw, env={})


async def stream(s: aiohttp.ClientSession, base: str, prompt_chars: int, max_tokens: int = 8,
                 headers: dict | None = None) -> dict:
    t0 = asyncio.get_running_loop().time()
    body = {"model": "m", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "x" * prompt_chars}]}
    url = base + "/v1/chat/completions"
    async with s.post(url, json=body, headers=headers or {}) as r:
        out = {"status": r.status, "headers": dict(r.headers)}
        if r.status != 200:
            out["body"] = await r.json()
            return out
        ttft = None
        async for line in r.content:
            if ttft is None and b'"content":"' in line and b'"content":""' not in line:
                ttft = asyncio.get_running_loop().time() - t0
        out["ttft"] = ttft
        return out


async def test_a_request_the_upstream_refused_is_charged_only_its_prompt() -> None:
    """tokens_per_minute reserves the prompt's estimate + max_tokens at admission. An upstream
    400 produced no completion: the request is charged its prompt as estimated, and the rest of
    the reservation comes back (the SDKs' rate-limit headers say how much is left)."""
    key = "gw-quota-key-0123456789"
    refusal = orjson.dumps({"error": {"message": "Unsupported parameter.", "type":
                                      "invalid_request_error", "param": None, "code": "bad"}})
    upstream = scripted_app([refusal], status=400, headers={"Content-Type": "application/json"})
    async with serve_app(upstream) as up:
        cfg = gw([("a", up)], auth={"mode": "keys", "keys": [{
            "tenant": "t", "sha256": hashlib.sha256(key.encode()).hexdigest(),
            "tokens_per_minute": 1000}]})
        async with serve_app(build_app(cfg)) as base, aiohttp.ClientSession() as s:
            async def ask(max_tokens: int) -> tuple[int, dict[str, str]]:
                async with s.post(base + "/v1/chat/completions", headers={
                        "Authorization": f"Bearer {key}"}, json={
                        "model": "m", "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": "hello"}]}) as r:
                    await r.read()
                    return r.status, dict(r.headers)

            # Each reserves ~930 of the 1000: the second fits only if the first got it back.
            assert (await ask(900))[0] == 400
            assert (await ask(900))[0] == 400
            status, headers = await ask(1000)  # more than a full bucket holds now: refused
    assert status == 429 and headers["x-slogate-admission"] == "quota_tokens_per_minute"
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    # two prompts of ~30 estimated tokens were charged, nothing else
    assert 900 <= int(headers["x-ratelimit-remaining-tokens"]) < 1000
    assert len(upstream[REQUESTS]) == 2


async def admission_state(s: aiohttp.ClientSession, base: str) -> dict:
    async with s.get(base + "/admin/admission") as r:
        return await r.json()


def test_rls_tracks_a_linear_system_and_adapts() -> None:
    rls = RLS([0.0, 0.0], lam=0.95)
    rng = random.Random(1)
    for _ in range(200):
        x = rng.uniform(0, 10)
        rls.update([1.0, x], 0.5 + 2.0 * x + rng.gauss(0, 0.01))
    assert rls.theta == pytest.approx([0.5, 2.0], abs=0.05)
    for _ in range(200):  # the system gets slower: slope doubles
        x = rng.uniform(0, 10)
        rls.update([1.0, x], 0.5 + 4.0 * x + rng.gauss(0, 0.01))
    assert rls.theta[1] == pytest.approx(4.0, abs=0.1)
    assert rls.stderr < 0.1


def test_prompt_ratio_calibrates_against_reported_usage() -> None:
    est = ReplicaEstimator()
    for _ in range(60):
        est.observe_prompt(4000, 500)  # 8 bytes per token
    assert est.tokens_per_byte == pytest.approx(0.125, rel=0.02)


async def test_estimator_converges_on_the_simulator_and_adapts_when_it_slows() -> None:
    # Prefill 20k tok/s in 2048-token chunks with a 4 ms step: ~0.05 s per 1k prompt tokens.
    sim_app = build_sim(SimConfig(prefill_tokens_per_s=20_000, decode_base_ms=4,
                                  decode_per_seq_ms=0.2, max_batch=64))
    async with serve_app(sim_app) as sim_url, serve_app(build_app(gw([("a", sim_url)]))) as base, \
            aiohttp.ClientSession() as s:
        rng = random.Random(7)
        for _ in range(30):
            await stream(s, base, rng.choice([400, 4000, 12000]), max_tokens=2)
        fast = (await admission_state(s, base))["replicas"]["a"]
        c1_fast = fast["ttft_model"]["s_per_1k_prompt_tokens"]
        assert fast["tokens_per_byte"] == pytest.approx(0.25, rel=0.25)  # the sim: 4 bytes/token
        assert 0.03 < c1_fast < 0.09, fast
        async with s.post(sim_url + "/sim/config", json={"prefill_tokens_per_s": 6000}) as r:
            assert r.status == 200
        for _ in range(30):
            await stream(s, base, rng.choice([400, 4000, 12000]), max_tokens=2)
        slow = (await admission_state(s, base))["replicas"]["a"]
    c1_slow = slow["ttft_model"]["s_per_1k_prompt_tokens"]
    assert c1_slow > 2.2 * c1_fast, (c1_fast, c1_slow)  # 3.3x slower prefill, learned online


async def test_overload_sheds_interactive_fast_and_queues_batch() -> None:
    """Far more interactive work than the engine can take within 400 ms: the surplus is
    rejected at once with 429 + Retry-After; batch requests wait and all complete; admitted
    interactive requests meet their TTFT within the estimator's stated error."""
    sim_app = build_sim(SimConfig(prefill_tokens_per_s=20_000, decode_base_ms=8,
                                  decode_per_seq_ms=1.0, max_batch=8))
    async with serve_app(sim_app) as sim_url:
        cfg = gw([("a", sim_url)], admission={"max_concurrency": 8})
        async with serve_app(build_app(cfg)) as base, aiohttp.ClientSession() as s:
            rng = random.Random(3)
            for _ in range(12):  # warm the estimators with light traffic
                await stream(s, base, rng.choice([400, 8000]), headers={"x-slo-class": "batch"})
            inter = [stream(s, base, 8000, max_tokens=30, headers={"x-slo-class": "interactive"})
                     for _ in range(60)]
            batch = [stream(s, base, 2000, max_tokens=20, headers={"x-slo-class": "batch"})
                     for _ in range(15)]
            results = await asyncio.gather(*inter, *batch)
            state = await admission_state(s, base)
            async with s.get(base + "/metrics") as r:
                metrics = await r.text()
    inter_r, batch_r = results[:60], results[60:]
    rejected = [r for r in inter_r if r["status"] == 429]
    admitted = [r for r in inter_r if r["status"] == 200]
    assert rejected and admitted, [r["status"] for r in inter_r]
    for r in rejected:
        assert int(r["headers"]["Retry-After"]) >= 1
        assert r["headers"]["x-slogate-admission"] in ("ttft_infeasible", "queue_full")
        assert r["body"]["error"]["code"].startswith("slo_")
    assert all(r["status"] == 200 for r in batch_r)  # batch waits, is never shed
    stated = state["replicas"]["a"]["ttft_model"]["stated_error_s"]
    late = [r["ttft"] for r in admitted if r["ttft"] > 0.4 + stated + 0.05]
    # TTFT as the client saw it includes the client's own scheduling on a shared 2-core
    # machine: one straggler in ten is that, more would be admission breaking its promise.
    assert len(late) <= max(1, len(admitted) // 10), (late, len(admitted), stated)
    assert 'decision="rejected"' in metrics and 'decision="queued"' in metrics
    # Each class's demand as fair admission weighs it: both asked, none holds a slot now, and
    # the shares (once learned) divide the 8 slots.
    classes = state["classes"]
    assert {"interactive", "batch"} <= classes.keys(), classes
    assert all(c["rate_per_s"] > 0 and c["in_flight"] == 0 for c in classes.values()), classes
    assert sum(c["share_slots"] or 0.0 for c in classes.values()) <= 8.01, classes


async def test_prefix_affinity_keeps_a_prefix_on_one_replica_until_the_load_bound() -> None:
    sims = [build_sim(SimConfig(prefill_tokens_per_s=50_000, decode_base_ms=3,
                                decode_per_seq_ms=0.1)) for _ in range(3)]
    async with serve_app(sims[0]) as a, serve_app(sims[1]) as b, serve_app(sims[2]) as c:
        cfg = gw([("a", a), ("b", b), ("c", c)],
                 admission={"prefix_affinity": True, "affinity_slack": 0.5})
        async with serve_app(build_app(cfg)) as base, aiohttp.ClientSession() as s:
            system = {"role": "system", "content": "You are a terse assistant. " * 20}

            async def ask(i: int, n_tokens: int = 4) -> None:
                body = {"model": "m", "stream": True, "max_tokens": n_tokens,
                        "messages": [system, {"role": "user", "content": f"question {i}"}]}
                async with s.post(base + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()

            for i in range(12):  # sequential: the affine replica is never loaded
                await ask(i)
            counts = []
            for sim_url in (a, b, c):
                async with s.get(sim_url + "/sim/stats") as r:
                    counts.append((await r.json())["requests"])
            assert sorted(counts) == [0, 0, 12], counts
            # Many at once with long prompts: the affine replica's predicted TTFT grows past
            # the bound and others take the overflow.
            await asyncio.gather(*(ask(100 + i, 40) for i in range(30)))
            after = []
            for sim_url in (a, b, c):
                async with s.get(sim_url + "/sim/stats") as r:
                    after.append((await r.json())["requests"])
    assert sum(after) == 42
    assert sorted(after)[-1] < 42 and sorted(after)[-2] > 0, after


async def test_admission_state_endpoint() -> None:
    sim_app = build_sim(SimConfig(decode_base_ms=2))
    async with serve_app(sim_app) as sim_url, serve_app(build_app(gw([("a", sim_url)]))) as base, \
            aiohttp.ClientSession() as s:
        await stream(s, base, 100)
        state = await admission_state(s, base)
    json.dumps(state)
    assert state["enabled"] and state["replicas"]["a"]["ttft_model"]["observations"] == 1


async def test_engine_metrics_show_load_from_clients_the_gateway_cannot_see() -> None:
    """Another client floods the engine directly. Scraping the engine's own /metrics, the
    gateway sees the queue and stops admitting interactive requests it would now make late."""
    sim_app = build_sim(SimConfig(max_batch=2, decode_base_ms=20, decode_per_seq_ms=0,
                                  prefill_tokens_per_s=20_000))
    async with serve_app(sim_app) as sim_url:
        cfg = gw([("a", sim_url)], admission={"engine_metrics": True,
                                              "engine_metrics_interval_s": 0.1})
        async with serve_app(build_app(cfg)) as base, aiohttp.ClientSession() as s:
            for _ in range(3):
                await stream(s, base, 2000, headers={"x-slo-class": "interactive"})
            others = [asyncio.create_task(stream(s, sim_url, 2000, max_tokens=60))
                      for _ in range(10)]

            async def engine_queue_seen() -> bool:
                state = (await admission_state(s, base))["replicas"]["a"]
                return state["engine"]["waiting"] >= 5

            await wait_until(engine_queue_seen, timeout=5.0, interval=0.05,
                             what="the gateway scraping >= 5 requests waiting in the engine")
            late = await stream(s, base, 2000, headers={"x-slo-class": "interactive"})
            assert late["status"] == 429, late
            for t in others:
                t.cancel()
