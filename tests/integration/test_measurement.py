"""Measurement truth (issue 13): one definition per duration, TTFT only from first tokens,
prefix-cache attribution, and which stage made a missed TTFT slow.

The first three tests are the findings on the old main, as regressions: a non-streamed answer
counted as a TTFT, an upstream 400 counted as a first token, and sinks that measured the same
name differently. Then each stage in turn made to dominate a TTFT with the simulator (and, for
the connect stage, a real listening socket with a full accept backlog), and the prefix cache.
Timing margins are generous (2-core shared machines); waits are on conditions.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import FINISHER_KEY, build_app
from tests.support.otlp_receiver import RECEIVER, receiver_app
from tests.support.servers import serve_app
from tests.support.waiting import wait_until

INTERACTIVE = {"name": "interactive", "ttft_ms": 250, "tpot_ms": 1000}
RELAXED = {"name": "relaxed", "ttft_ms": 1000, "tpot_ms": 1000}
BATCH = {"name": "batch", "ttft_ms": 60000, "tpot_ms": 1000}
BATCH_CLASS = {"x-slo-class": "batch"}
FAST = dict(decode_base_ms=5, decode_per_seq_ms=0, prefill_tokens_per_s=1e6)
CHAT = "/v1/chat/completions"


def gw_config(upstream: str, provider: str = "groq", **extra: Any) -> config.Config:
    raw: dict[str, Any] = {
        "auth": {"mode": "open"}, "server": {"access_log": True},
        "slo": {"default": "interactive"}, "slo_classes": [INTERACTIVE, RELAXED, BATCH],
        "backends": [{"name": "sim", "base_url": upstream + "/v1", "provider": provider,
                      "models": ["m"], "forward_headers": ["x-sim-*"]}]}
    raw.update(extra)
    return config.parse(raw, env={})


def access_log(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, Any]]:
    """request id -> its access-log record."""
    out = {}
    for r in caplog.records:
        if r.name == "slogate.access":
            rec = json.loads(r.getMessage())
            out[rec["request_id"]] = rec
    return out


async def scrape(s: aiohttp.ClientSession, gw: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value of the gateway's /metrics."""
    async with s.get(gw + "/metrics") as r:
        text = await r.text()
    return {(smp.name, frozenset(smp.labels.items())): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def total(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def quantile(samples: dict[tuple[str, frozenset], float], hist: str, q: float,
             **labels: str) -> float:
    """histogram_quantile over the buckets of `hist` matching `labels` (summed), as PromQL
    computes it (linear inside the bucket)."""
    buckets: dict[float, float] = {}
    for (n, ls), v in samples.items():
        d = dict(ls)
        if n == hist + "_bucket" and all(d.get(k) == x for k, x in labels.items()):
            le = float(d["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    bounds = sorted(buckets)
    count = buckets[bounds[-1]]
    assert count > 0, (hist, labels)
    rank, prev_b, prev_c = q * count, 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if b == float("inf"):
                return prev_b
            return prev_b + (b - prev_b) * (rank - prev_c) / max(buckets[b] - prev_c, 1e-12)
        prev_b, prev_c = b, buckets[b]
    raise AssertionError("unreachable")


async def post(s: aiohttp.ClientSession, gw: str, *, stream: bool = True, content: str = "hi",
               headers: dict[str, str] | None = None, max_tokens: int = 4,
               on_first_chunk: Callable[[], None] | None = None,
               system: str | None = None) -> tuple[str, int]:
    """One chat request; returns (request id, status)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}]
    async with s.post(gw + CHAT, headers=headers or {}, json={
            "model": "m", "stream": stream, "max_tokens": max_tokens, "messages": messages}) as r:
        async for _ in r.content.iter_any():
            if on_first_chunk is not None:
                on_first_chunk()
                on_first_chunk = None
        return r.headers["x-slogate-request-id"], r.status


async def flush(app: web.Application) -> None:
    finisher = app[FINISHER_KEY]
    if finisher.tracing.enabled:
        await asyncio.to_thread(finisher.tracing.provider.force_flush)
    if finisher.otlp.enabled:
        await asyncio.to_thread(finisher.otlp.provider.force_flush)


# -- the three findings, as regressions --------------------------------------------------------

async def test_a_non_streamed_answer_is_no_ttft_but_an_e2e(caplog) -> None:
    """Finding 1: a non-streamed request's whole duration moved the TTFT histogram exactly as
    much as the E2E histogram. Now it goes to E2E (stream="false") only, and its verdict is
    still its whole answer against the TTFT target (no e2e target in its class)."""
    caplog.set_level(logging.INFO, logger="slogate.access")
    async with serve_app(build_sim(SimConfig(decode_base_ms=10, decode_per_seq_ms=0))) as sim:
        async with serve_app(build_app(gw_config(sim))) as gw, aiohttp.ClientSession() as s:
            slow, _ = await post(s, gw, stream=False, max_tokens=40)  # ~0.4 s > 250 ms
            quick, _ = await post(s, gw, stream=False, headers=BATCH_CLASS)
            m = await scrape(s, gw)
    assert total(m, "slogate_time_to_first_token_seconds_count") == 0
    assert total(m, "slogate_time_to_first_token_seconds_sum") == 0
    assert total(m, "slogate_request_duration_seconds_count", stream="false") == 2
    assert total(m, "slogate_request_duration_seconds_sum", stream="false") > 0.3
    assert total(m, "slogate_ttft_miss_total") == 0  # no first token, no stage to blame
    log = access_log(caplog)
    for rid in (slow, quick):
        assert "ttft" not in log[rid]["ms"] and "ttft_stages_ms" not in log[rid]
        assert log[rid]["ms"]["e2e"] > 0
    assert log[slow]["verdict"] == "ttft_missed" and log[quick]["verdict"] == "met"


async def test_an_upstream_error_is_never_a_first_token(caplog) -> None:
    """Finding 2: an upstream 400 passed through for a non-streamed request counted as a first
    token (TTFT count +1, a `ttft` in the access log). Streamed or not, an error answer has no
    TTFT in Prometheus, OTLP or the log."""
    caplog.set_level(logging.INFO, logger="slogate.access")
    otlp = receiver_app()
    async with serve_app(otlp) as otlp_url, serve_app(build_sim(SimConfig(**FAST))) as sim:
        app = build_app(gw_config(sim, telemetry={"otlp_endpoint": otlp_url}))
        async with serve_app(app) as gw, aiohttp.ClientSession() as s:
            ids = [await post(s, gw, stream=stream, headers={"x-sim-status": "400"})
                   for stream in (False, True)]
            m = await scrape(s, gw)
            await flush(app)
    assert [status for _, status in ids] == [400, 400]
    assert total(m, "slogate_time_to_first_token_seconds_count") == 0
    assert total(m, "slogate_requests_total", outcome="upstream_error") == 2
    log = access_log(caplog)
    for rid, _ in ids:
        assert log[rid]["outcome"] == "upstream_error"
        assert not {"ttft", "first_event", "upstream_ttft", "decode"} & set(log[rid]["ms"])
    got = otlp[RECEIVER].metrics
    assert "slogate.time_to_first_token" not in got
    assert "gen_ai.client.operation.time_to_first_chunk" not in got
    assert sum(p.count for p in got["gen_ai.client.operation.duration"]) == 2


async def test_every_sink_reads_the_same_definition(caplog) -> None:
    """Finding 3: the Prometheus gateway queue ended at the last attempt's send while the log
    ended it at the first attempt's; time to first chunk was counted from the upstream send in
    spans and from receipt in OTLP. With a retried request (503 + Retry-After first), every
    sink now reports the same value for each name."""
    caplog.set_level(logging.INFO, logger="slogate.access")
    otlp = receiver_app()
    sim_cfg = SimConfig(**FAST, fault_status=503, fault_status_count=1, retry_after_s=0.2)
    async with serve_app(otlp) as otlp_url, serve_app(build_sim(sim_cfg)) as sim:
        app = build_app(gw_config(sim, telemetry={"otlp_endpoint": otlp_url}))
        async with serve_app(app) as gw, aiohttp.ClientSession() as s:
            rid, status = await post(s, gw)
            m = await scrape(s, gw)
            await flush(app)
    assert status == 200
    ms = access_log(caplog)[rid]["ms"]
    rec = otlp[RECEIVER]
    (server,) = rec.by_name("chat m")
    (queue_span,) = rec.by_name("gateway.queue")
    otlp_metrics = rec.metrics

    def one(name: str) -> float:
        (point,) = otlp_metrics[name]
        assert point.count == 1
        return float(point.sum)

    assert ms["retries"] >= 150  # the Retry-After wait is not the gateway queue
    gateway_queue = [ms["gateway_queue"] / 1e3,
                     total(m, "slogate_gateway_queue_seconds_sum"),
                     (queue_span.end - queue_span.start) / 1e9]
    first_chunk = [ms["first_event"] / 1e3,
                   one("gen_ai.client.operation.time_to_first_chunk"),
                   server.attrs["gen_ai.response.time_to_first_chunk"]]
    ttft = [ms["ttft"] / 1e3, one("slogate.time_to_first_token"),
            total(m, "slogate_time_to_first_token_seconds_sum"),
            server.attrs["slogate.ttft_ms"] / 1e3]
    e2e = [ms["e2e"] / 1e3, one("gen_ai.client.operation.duration"),
           total(m, "slogate_request_duration_seconds_sum")]
    for values in (gateway_queue, first_chunk, ttft, e2e):
        assert max(values) - min(values) < 2e-6, values
    assert gateway_queue[0] < 0.15 < ttft[0]


# -- why a TTFT was slow: each stage in turn ---------------------------------------------------

@contextlib.asynccontextmanager
async def late_listener(
        app: web.Application) -> AsyncIterator[tuple[str, Callable[[], Awaitable[None]]]]:
    """`app` on a loopback socket whose accept queue is full (listen backlog 0, one connection
    not accepted): a new connection's SYN is dropped and the client's kernel resends it after
    its initial RTO (1 s on Linux). Yields the URL and a coroutine that starts serving (which
    makes room), so a connect in flight then completes on the SYN's retransmission."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)
    port = sock.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))  # fills the accept queue
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()

    async def start() -> None:
        await web.SockSite(runner, sock).start()

    try:
        yield f"http://127.0.0.1:{port}", start
    finally:
        filler.close()
        await runner.cleanup()
        sock.close()


def listen_overflows() -> int:
    """TcpExt ListenOverflows: SYNs dropped because an accept queue was full."""
    with open("/proc/net/netstat") as f:
        lines = [line.split() for line in f if line.startswith("TcpExt:")]
    return int(lines[1][lines[0].index("ListenOverflows")])


async def _behind(s: aiohttp.ClientSession, gw: str, holder_tokens: int, **kw: Any) -> str:
    """A long batch-class request holds the engine (or the admission slot); the measured one
    is sent once that request's first chunk arrived."""
    started = asyncio.Event()
    holder = asyncio.create_task(post(s, gw, headers=BATCH_CLASS, max_tokens=holder_tokens,
                                      on_first_chunk=started.set))
    await started.wait()
    rid, status = await post(s, gw, **kw)
    await holder
    assert status == 200
    return rid


SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # stage: (simulator knobs, gateway config extras)
    "gateway_queue": ({"decode_base_ms": 10, "decode_per_seq_ms": 0},
                      {"admission": {"enabled": True, "max_concurrency": 1}}),
    "engine_queue": ({"decode_base_ms": 10, "decode_per_seq_ms": 0, "max_batch": 1}, {}),
    "prefill": ({"decode_base_ms": 5, "decode_per_seq_ms": 0, "prefill_tokens_per_s": 20000}, {}),
    "first_token_after_headers": (FAST, {}),
    "upstream_connect": (FAST, {}),
}


@pytest.mark.parametrize("stage", list(SCENARIOS))
async def test_a_missed_ttft_names_the_stage_that_took_longest(stage: str, caplog) -> None:
    """The simulator (Groq flavour: it reports queue and prefill) is made slow in one stage;
    the request misses its TTFT target (250 ms; 1 s behind admission), and the miss counter,
    the access log and the span attributes all name that stage, whose share of the TTFT is the
    largest."""
    caplog.set_level(logging.INFO, logger="slogate.access")
    knobs, extra = SCENARIOS[stage]
    sim_app = build_sim(SimConfig(**knobs, provider="groq"))
    otlp = receiver_app()
    async with contextlib.AsyncExitStack() as stack:
        otlp_url = await stack.enter_async_context(serve_app(otlp))
        if stage == "upstream_connect":
            sim, start_serving = await stack.enter_async_context(late_listener(sim_app))
        else:
            sim = await stack.enter_async_context(serve_app(sim_app))
        app = build_app(gw_config(sim, telemetry={"otlp_endpoint": otlp_url}, **extra))
        gw = await stack.enter_async_context(serve_app(app))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        slo_class = "interactive"
        if stage == "engine_queue":  # ~0.6 s behind the holder in the engine's queue
            rid = await _behind(s, gw, 60)
        elif stage == "gateway_queue":
            # Admission holds it (one request per replica) while the holder runs (~0.75 s of
            # its 1 s target: an admission queue drops a request only once its target is out
            # of reach), then the engine stalls it 0.45 s: the wait was the largest part.
            slo_class = "relaxed"
            rid = await _behind(s, gw, 75, headers={"x-slo-class": slo_class,
                                                    "x-sim-stall-ms": "450"})
        elif stage == "prefill":  # 40 kB = 10k tokens at 20k tokens/s: 0.5 s of prefill
            rid, _ = await post(s, gw, content="x" * 40_000)
        elif stage == "first_token_after_headers":
            rid, _ = await post(s, gw, headers={"x-sim-stall-ms": "600"})
        else:
            dropped = listen_overflows()
            request = asyncio.create_task(post(s, gw))
            await wait_until(lambda: listen_overflows() > dropped, timeout=10,
                             what="our SYN dropped by the full accept queue")
            await start_serving()
            rid, _ = await request
        m = await scrape(s, gw)
        await flush(app)
    rec = access_log(caplog)[rid]
    assert rec["verdict"] in ("ttft_missed", "both_missed"), rec
    assert rec["ttft_miss_stage"] == stage, rec
    stages = rec["ttft_stages_ms"]
    assert abs(sum(stages.values()) - rec["ms"]["ttft"]) < 0.01  # a partition of the TTFT
    assert stages[stage] > (0.45 if stage == "gateway_queue" else 0.5) * rec["ms"]["ttft"], stages
    assert total(m, "slogate_ttft_miss_total", slo_class=slo_class, stage=stage) == 1
    assert total(m, "slogate_ttft_miss_total") == 1
    assert total(m, "slogate_ttft_miss_stage_seconds_total", stage=stage) > 0.2
    (server,) = [sp for sp in otlp[RECEIVER].by_name("chat m")
                 if sp.attrs["slogate.request_id"] == rid]
    assert server.attrs["slogate.ttft.miss_stage"] == stage
    assert server.attrs[f"slogate.ttft.{stage}_ms"] == stages[stage]
    if stage in ("engine_queue", "prefill"):  # reported by the provider (Groq's x_groq.usage)
        assert server.attrs[f"slogate.ttft.{stage}.source"] == "provider"
    else:
        assert server.attrs[f"slogate.ttft.{stage}.source"] in ("measured", "inferred")
    if stage == "prefill":
        assert rec["prompt_length"] == "4k-16k"
    if stage == "gateway_queue":  # the wait was admission's, and every sink says so
        wait = rec["ms"]["admission_wait"]
        assert wait > 0.8 * stages["gateway_queue"]
        (span,) = [sp for sp in otlp[RECEIVER].by_name("gateway.admission_wait")
                   if sp.parent_id == server.span_id]
        assert abs((span.end - span.start) / 1e6 - wait) < 0.002
        assert total(m, "slogate_admission_queue_wait_seconds_sum") == pytest.approx(
            wait / 1e3, abs=2e-6)


# -- the prefix cache --------------------------------------------------------------------------

async def test_prefix_cache_hits_show_in_the_hit_ratio_and_a_faster_hit_bucket(caplog) -> None:
    """The simulator's prefix cache (2000 of ~2000 prompt tokens on a repeat, 100 ms of
    prefill on a miss): the hit ratio counts the cached tokens, and P99 TTFT of the `hit`
    bucket is below that of `miss`."""
    caplog.set_level(logging.INFO, logger="slogate.access")
    sim_cfg = SimConfig(decode_base_ms=5, decode_per_seq_ms=0, prefill_tokens_per_s=20000,
                        prefix_cache_bytes=8000, prompt_tokens_details=True)
    async with serve_app(build_sim(sim_cfg)) as sim:
        async with serve_app(build_app(gw_config(sim, provider="vllm"))) as gw, \
                aiohttp.ClientSession() as s:
            for conversation in range(6):
                system = f"{conversation:04d}" * 2000  # 8000 bytes: the cached prefix
                for turn in range(4):  # the first turn misses, the next ones hit
                    await post(s, gw, system=system, content=f"turn {turn}", headers=BATCH_CLASS)
            m = await scrape(s, gw)
    cached = total(m, "slogate_prompt_cache_tokens_total", model="m", kind="cached")
    uncached = total(m, "slogate_prompt_cache_tokens_total", model="m", kind="uncached")
    assert 0.6 < cached / (cached + uncached) < 0.8  # 18 of 24 requests hit ~all of it
    by_prompt = "slogate_time_to_first_token_by_prompt_seconds"
    assert total(m, by_prompt + "_count", prefix_cache="hit") == 18
    assert total(m, by_prompt + "_count", prefix_cache="miss") == 6
    hit_p99 = quantile(m, by_prompt, 0.99, prefix_cache="hit")
    miss_p99 = quantile(m, by_prompt, 0.99, prefix_cache="miss")
    assert hit_p99 < miss_p99 and miss_p99 > 0.09, (hit_p99, miss_p99)
    buckets = [r.get("prefix_cache") for r in access_log(caplog).values()]
    assert buckets.count("hit") == 18 and buckets.count("miss") == 6


# One request per API format and provider flavour, each asked twice: the second reads the
# prefix the first wrote. (route, simulator flavour header, gateway backend, request body)
FORMATS = {
    "chat/vllm": (CHAT, "vllm", "sim"),
    "chat/groq": (CHAT, "groq", "sim"),
    "chat/cerebras": (CHAT, "cerebras", "sim"),
    "responses": ("/v1/responses", "vllm", "sim"),
    "messages": ("/v1/messages", "vllm", "anthropic"),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("stream", [True, False])
async def test_cached_tokens_from_every_format_reach_the_log_and_spans(fmt: str, stream: bool,
                                                                       caplog) -> None:
    caplog.set_level(logging.INFO, logger="slogate.access")
    route, flavour, backend = FORMATS[fmt]
    sim_cfg = SimConfig(**FAST, prefix_cache_bytes=4000, prompt_tokens_details=True)
    otlp = receiver_app()
    system = "s" * 4000
    async with serve_app(otlp) as otlp_url, serve_app(build_sim(sim_cfg)) as sim:
        cfg = gw_config(sim, provider="vllm", telemetry={"otlp_endpoint": otlp_url},
                        backends=[{"name": "sim", "base_url": sim + "/v1", "provider": "vllm",
                                   "models": ["m"], "forward_headers": ["x-sim-*"]},
                                  {"name": "anthropic", "type": "anthropic",
                                   "base_url": sim + "/v1", "models": ["m"],
                                   "forward_headers": ["x-sim-*"]}])
        app = build_app(cfg)
        async with serve_app(app) as gw, aiohttp.ClientSession() as s:
            ids = []
            for turn in ("one", "two"):
                if route == "/v1/responses":
                    body: dict[str, Any] = {"model": "m", "stream": stream, "instructions": system,
                                            "input": turn, "max_output_tokens": 3}
                elif route == "/v1/messages":
                    body = {"model": "m", "stream": stream, "system": system, "max_tokens": 3,
                            "messages": [{"role": "user", "content": turn}]}
                else:
                    body = {"model": "m", "stream": stream, "max_tokens": 3,
                            "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": turn}]}
                async with s.post(gw + route, json=body, headers={
                        "x-sim-provider": flavour, "anthropic-version": "2023-06-01"}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                    ids.append(r.headers["x-slogate-request-id"])
            m = await scrape(s, gw)
            await flush(app)
    log = access_log(caplog)
    first, second = log[ids[0]], log[ids[1]]
    assert first["backend"] == backend
    assert first["cached_tokens"] == 0 and first["prefix_cache"] == "miss"
    assert second["cached_tokens"] == 1000 and second["prefix_cache"] == "hit"
    assert second["prompt_tokens"] > 1000
    if fmt == "messages":  # Anthropic reports the prefix a miss writes
        assert first["cache_write_tokens"] == 1000 and second["cache_write_tokens"] == 0
    spans = {sp.attrs["slogate.request_id"]: sp for sp in otlp[RECEIVER].spans
             if "slogate.request_id" in sp.attrs}
    assert spans[ids[1]].attrs["gen_ai.usage.cache_read.input_tokens"] == 1000
    assert spans[ids[1]].attrs["slogate.prefix_cache"] == "hit"
    assert total(m, "slogate_prompt_cache_tokens_total", backend=backend, kind="cached") == 1000


def test_readme_lists_every_declared_duration_and_stage() -> None:
    """docs/telemetry.md's Durations table is the one in gateway/telemetry/durations.py: every
    duration with its stamps, and every TTFT stage."""
    from pathlib import Path

    from gateway.telemetry.attribution import STAGES
    from gateway.telemetry.durations import DURATIONS

    readme = (Path(__file__).resolve().parents[2] / "docs" / "telemetry.md").read_text()
    for d in DURATIONS:
        assert f"| `{d.name}` | `{d.start}` → `{d.end}` | {d.when} | {d.where} |" in readme, d.name
    for stage in STAGES:
        assert f"| `{stage}` |" in readme, stage
