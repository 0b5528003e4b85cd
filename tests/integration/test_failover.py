"""Deadlines, failover before commit, clean mid-stream failures, keepalive, breaker, drain —
over real sockets, with the simulator's fault injection and the official SDKs."""
from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import FINISHER_KEY, build_app
from tests.support.otlp_receiver import RECEIVER, receiver_app
from tests.support.procs import sim_and_gateway
from tests.support.prometheus_server import free_port
from tests.support.servers import serve_app
from tests.support.upstreams import REQUESTS, scripted_app, tokens
from tests.support.waiting import wait_until

FAST = dict(decode_base_ms=2, decode_per_seq_ms=0, prefill_tokens_per_s=1e6)
MSG = [{"role": "user", "content": "hello"}]


def gw(backends: list[tuple[str, str]], **sections) -> config.Config:
    raw = {"auth": {"mode": "open"}, "server": {"access_log": True},
           "backends": [{"name": n, "base_url": u + "/v1", "models": ["m"]} for n, u in backends]}
    raw.update(sections)
    return config.parse(raw, env={})


async def metrics_text(base: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        return await r.text()


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def sdk_stream(base: str, **kw) -> tuple[str, float]:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    try:
        t0 = time.perf_counter()
        ttft = None
        parts = []
        stream = await client.chat.completions.create(model="m", stream=True, messages=MSG, **kw)
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                parts.append(c.choices[0].delta.content)
        return "".join(parts), ttft or 0.0
    finally:
        await client.close()


async def test_stall_on_one_replica_fails_over_to_the_next() -> None:
    otlp = receiver_app()
    async with serve_app(build_sim(SimConfig(**FAST, stall_ms=10_000))) as a, \
            serve_app(build_sim(SimConfig(**FAST))) as b, serve_app(otlp) as otlp_url:
        app = build_app(gw([("a", a), ("b", b)], timeouts={"first_token_s": 0.5},
                           telemetry={"otlp_endpoint": otlp_url}))
        async with serve_app(app) as base:
            text, ttft = await sdk_stream(base, max_tokens=5)
            await asyncio.to_thread(app[FINISHER_KEY].tracing.provider.force_flush)
            text_m = await metrics_text(base)
            async with aiohttp.ClientSession() as s, s.get(a + "/sim/stats") as r:
                a_stats = await r.json()
    assert text
    assert 0.5 <= ttft < 1.5  # the deadline, then B's own (fast) TTFT
    spans = otlp[RECEIVER].by_name("upstream")
    (server,) = otlp[RECEIVER].by_name("chat m")
    assert len(spans) == 2 and all(s.parent_id == server.span_id for s in spans)
    first, second = sorted(spans, key=lambda s: s.start)
    assert first.attrs["slogate.backend"] == "a"
    assert first.attrs["error.type"] == "first_token_timeout"
    assert second.attrs["slogate.backend"] == "b" and "error.type" not in second.attrs
    assert first.end <= second.start
    assert metric(text_m, "slogate_upstream_attempts_total", backend="a",
                  result="first_token_timeout") == 1
    assert metric(text_m, "slogate_upstream_attempts_total", backend="b", result="ok") == 1
    assert sum(a_stats["cancellations"].values()) == 1  # A was told at once


async def test_role_chunk_and_pings_are_not_a_first_token() -> None:
    sim = SimConfig(**FAST, role_first=True, ping_ms=50, hang="first_token")
    async with serve_app(build_sim(sim)) as up:
        app = build_app(gw([("a", up)], timeouts={"first_token_s": 0.4}, retry={"max_attempts": 1}))
        async with serve_app(app) as base, aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(base + "/v1/chat/completions",
                              json={"model": "m", "stream": True, "messages": MSG}) as r:
                body = await r.read()
                elapsed = time.monotonic() - t0
                assert r.status == 504
    assert orjson.loads(body)["error"]["code"] == "first_token_timeout"
    assert 0.4 <= elapsed < 1.5


def flaky_upstream(failures: list[tuple[int, dict[str, str]]]) -> web.Application:
    """Answers the listed (status, headers) first, then streams a short answer."""
    app = scripted_app([
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}\n\n',
        b"data: [DONE]\n\n"])
    queue = list(failures)

    @web.middleware
    async def fail_first(request: web.Request, handler):
        if queue:
            status, headers = queue.pop(0)
            await request.read()
            app[REQUESTS].append({"path": request.path, "status": status})
            return web.json_response({"error": {"message": "busy", "type": "overloaded",
                                                "param": None, "code": None}},
                                     status=status, headers=headers)
        return await handler(request)

    app.middlewares.append(fail_first)
    return app


async def test_503_with_retry_after_is_honoured_then_succeeds() -> None:
    up = flaky_upstream([(503, {"Retry-After": "1"})])
    async with serve_app(up) as up_url, serve_app(build_app(gw([("a", up_url)]))) as base:
        t0 = time.monotonic()
        text, _ = await sdk_stream(base)
        elapsed = time.monotonic() - t0
        m = await metrics_text(base)
    assert text == "ok"
    assert 1.0 <= elapsed < 2.5
    assert len(up[REQUESTS]) == 2
    assert metric(m, "slogate_upstream_attempts_total", result="http_503") == 1


async def test_429_storm_stops_at_the_attempt_limit_and_passes_the_429_through() -> None:
    up = flaky_upstream([(429, {"Retry-After": "0"})] * 10)
    async with serve_app(up) as up_url, \
            serve_app(build_app(gw([("a", up_url)], retry={"max_attempts": 3}))) as base:
        client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="m", stream=True, messages=MSG)
        await client.close()
    assert len(up[REQUESTS]) == 3


async def test_retry_after_beyond_the_cap_is_not_waited_for() -> None:
    up = flaky_upstream([(429, {"Retry-After": "100"})] * 5)
    async with serve_app(up) as up_url, serve_app(build_app(gw([("a", up_url)]))) as base, \
            aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(base + "/v1/chat/completions",
                          json={"model": "m", "stream": True, "messages": MSG}) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "100"
            await r.read()
        assert time.monotonic() - t0 < 1
    assert len(up[REQUESTS]) == 1  # the client's SDK decides what to do with 100 s


async def test_cut_mid_stream_raises_in_the_sdk_and_is_counted() -> None:
    async with serve_app(build_sim(SimConfig(**FAST, cut_after=10))) as up, \
            serve_app(build_app(gw([("a", up)]))) as base:
        client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        got = []
        with pytest.raises(openai.APIError) as e:
            stream = await client.chat.completions.create(model="m", stream=True, messages=MSG,
                                                          max_tokens=50)
            async for c in stream:
                if c.choices and c.choices[0].delta.content:
                    got.append(c.choices[0].delta.content)
        await client.close()
        m = await metrics_text(base)
    assert len(got) == 10
    assert "closed the stream before it was complete" in str(e.value)
    assert metric(m, "slogate_stream_interruptions_total") == 1


@pytest.mark.parametrize("deadline,script,code", [
    ({"idle_s": 0.3}, tokens(3, 0.01) + [5.0] + tokens(3, 0.01), "idle_timeout"),
    ({"total_s": 1.0}, tokens(40, 0.1), "total_timeout"),
])
async def test_deadlines_mid_stream_end_with_an_error_event(deadline, script, code) -> None:
    up = scripted_app(script + [b"data: [DONE]\n\n"])
    async with serve_app(up) as up_url, \
            serve_app(build_app(gw([("a", up_url)], timeouts=deadline))) as base, \
            aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(base + "/v1/chat/completions",
                          json={"model": "m", "stream": True, "messages": MSG}) as r:
            body = await r.read()
        elapsed = time.monotonic() - t0
        m = await metrics_text(base)
    events = [e for e in body.split(b"\n\n") if e]
    assert orjson.loads(events[-1][6:])["error"]["code"] == code
    assert b"[DONE]" not in body
    assert elapsed < 2.0
    assert metric(m, "slogate_stream_interruptions_total", reason=code) == 1


async def test_header_can_tighten_a_deadline_but_not_extend_it() -> None:
    up = scripted_app(tokens(1, 0.6) + [b"data: [DONE]\n\n"])
    async with serve_app(up) as up_url, \
            serve_app(build_app(gw([("a", up_url)], timeouts={"idle_s": 5},
                                   auth={"mode": "open", "timeout_overrides": True}))) as base, \
            aiohttp.ClientSession() as s:
        body = {"model": "m", "stream": True, "messages": MSG}
        async with s.post(base + "/v1/chat/completions", json=body,
                          headers={"x-slogate-timeout-total-ms": "300"}) as r:
            assert b"total_timeout" in await r.read()
        async with s.post(base + "/v1/chat/completions", json=body,
                          headers={"x-slogate-timeout-total-ms": "nope"}) as r:
            assert r.status == 400


async def test_breaker_opens_after_failures_and_closes_after_the_probe() -> None:
    dead_port = free_port()
    async with serve_app(build_sim(SimConfig(**FAST))) as b:
        cfg = gw([("a", f"http://127.0.0.1:{dead_port}"), ("b", b)],
                 breaker={"failures": 2, "cooldown_s": 1.0})
        async with serve_app(build_app(cfg)) as base:
            for _ in range(6):  # every request succeeds: A's failures fail over to B
                assert (await sdk_stream(base, max_tokens=2))[0]
            m = await metrics_text(base)
            assert metric(m, "slogate_upstream_attempts_total", backend="a",
                          result="connect_error") == 2
            assert metric(m, "slogate_backend_breaker_state", backend="a") == 2  # open
            async with aiohttp.ClientSession() as s, s.get(base + "/readyz") as r:
                assert r.status == 200  # B still serves the model
            # A comes back; after the cooldown one probe closes the breaker.
            async with serve_app(build_sim(SimConfig(**FAST)), port=dead_port):
                await asyncio.sleep(1.1)  # the 1 s cooldown passes (the gateway's real clock)
                for _ in range(4):
                    assert (await sdk_stream(base, max_tokens=2))[0]
                m = await metrics_text(base)
    assert metric(m, "slogate_backend_breaker_state", backend="a") == 0
    assert metric(m, "slogate_upstream_attempts_total", backend="a", result="ok") >= 1


async def test_a_model_without_healthy_backend_is_in_admin_backends_not_readyz() -> None:
    """/readyz is this process's readiness: a model's dead backend would otherwise take every
    gateway pod out of rotation, for every model. Its health is in /admin/backends."""
    cfg = gw([("a", f"http://127.0.0.1:{free_port()}")],
             breaker={"failures": 1, "cooldown_s": 30})
    async with serve_app(build_app(cfg)) as base, aiohttp.ClientSession() as s:
        async with s.get(base + "/readyz") as r:
            assert r.status == 200
        async with s.post(base + "/v1/chat/completions",
                          json={"model": "m", "messages": MSG}) as r:
            assert r.status == 502
        async with s.post(base + "/v1/chat/completions",
                          json={"model": "m", "messages": MSG}) as r:
            assert r.status == 503 and int(r.headers["Retry-After"]) > 1
            assert (await r.json())["error"]["code"] == "no_healthy_backend"
        async with s.get(base + "/readyz") as r:
            assert r.status == 200
        async with s.get(base + "/admin/backends") as r:
            health = await r.json()
        assert health["models_without_backend"] == ["m"]
        assert health["replicas"]["a"]["breaker"] == "open"
        async with s.get(base + "/healthz?verbose=1") as r:
            assert (await r.json())["models_without_backend"] == ["m"]


async def test_active_health_check_marks_a_replica_down() -> None:
    sim_app = build_sim(SimConfig(**FAST))
    async with serve_app(sim_app) as up:
        raw_backend = {"name": "a", "base_url": up + "/v1", "models": ["m"],
                       "health_path": "/nope", "health_interval_s": 0.1}
        cfg = config.parse({"auth": {"mode": "open"}, "backends": [raw_backend]}, env={})
        async with serve_app(build_app(cfg)) as base, aiohttp.ClientSession() as s:

            async def marked_down() -> bool:  # the first check (every 0.1 s) gets a 404
                async with s.get(base + "/admin/backends") as r:
                    return (await r.json())["replicas"]["a"]["healthy"] is False

            await wait_until(marked_down, timeout=2, what="/admin/backends showing a down")
            async with s.get(base + "/readyz") as r:
                assert r.status == 200  # this process is ready; the backend is not


async def test_sigterm_drains_live_streams() -> None:
    """20 live streams at SIGTERM: each completes or ends with an error event; /readyz turns
    false first; the process exits 0."""
    toml = """
[auth]
mode = "open"
[server]
drain_timeout_s = 1.0
readiness_grace_s = 0.4
access_log = false
[[backends]]
name = "sim"
base_url = "SIM_URL/v1"
models = ["m"]
"""
    async with sim_and_gateway(("--decode-base-ms", "30", "--decode-per-seq-ms", "0"),
                               config_toml=toml) as (sim, gwp):
        async with aiohttp.ClientSession() as s:
            started = asyncio.Event()
            count = 0

            async def one(i: int) -> bytes:
                nonlocal count
                body = {"model": "m", "stream": True, "messages": MSG,
                        "max_tokens": 5 if i % 2 else 200}
                async with s.post(gwp.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    count += 1
                    if count == 20:
                        started.set()
                    return await r.read()

            tasks = [asyncio.create_task(one(i)) for i in range(20)]
            await asyncio.wait_for(started.wait(), 10)
            t0 = time.monotonic()
            gwp.popen.send_signal(signal.SIGTERM)

            async def not_ready() -> bool:
                async with s.get(gwp.url + "/readyz") as r:
                    return r.status == 503

            # the balancer learns first
            await wait_until(not_ready, timeout=2, what="/readyz answering 503 after SIGTERM")
            bodies = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(gwp.popen.wait, 10)
            elapsed = time.monotonic() - t0
    assert code == 0
    done = ended = 0
    for body in bodies:
        last = [e for e in body.split(b"\n\n") if e][-1]
        if last == b"data: [DONE]":
            done += 1
        else:
            assert orjson.loads(last[6:])["error"]["code"] == "shutdown", last
            ended += 1
    assert done == 10 and ended == 10  # short ones finished; long ones were ended cleanly
    assert elapsed < 4.0


async def test_fallback_model_is_tried_before_going_back_to_a_failed_replica() -> None:
    bad = flaky_upstream([(503, {})] * 10)
    async with serve_app(bad) as bad_url, serve_app(build_sim(SimConfig(**FAST))) as good:
        cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": False},
                            "fallbacks": {"big": ["small"]},
                            "backends": [{"name": "b", "base_url": bad_url + "/v1",
                                          "models": ["big"]},
                                         {"name": "s", "base_url": good + "/v1",
                                          "models": ["small"]}]}, env={})
        async with serve_app(build_app(cfg)) as base:
            client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            r = await client.chat.completions.create(model="big", messages=MSG, max_tokens=3)
            await client.close()
    assert r.choices[0].message.content
    assert len(bad[REQUESTS]) == 1  # one failure, then the fallback model


async def test_a_backend_with_a_longer_first_token_deadline_still_fails_over() -> None:
    async with serve_app(build_sim(SimConfig(**FAST, stall_ms=10_000))) as a, \
            serve_app(build_sim(SimConfig(**FAST))) as b:
        cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": False},
                            "timeouts": {"first_token_s": 0.3},
                            "backends": [{"name": "a", "base_url": a + "/v1", "models": ["m"],
                                          "timeouts": {"first_token_s": 0.6}},
                                         {"name": "b", "base_url": b + "/v1", "models": ["m"],
                                          "timeouts": {"first_token_s": 0.6}}]}, env={})
        async with serve_app(build_app(cfg)) as base:
            text, ttft = await sdk_stream(base, max_tokens=3)
    assert text and 0.6 <= ttft < 1.5
