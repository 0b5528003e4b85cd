"""The first-token race: a stream of a class with `hedge_after_ms` whose first token is late
gets a second attempt on another replica; the first with a token is the client's answer (byte
for byte the same as that replica's unraced answer, through the openai SDK), the other is
cancelled at once; a budget per tenant caps the races; everything is counted."""
from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.upstreams import CANCELLED, REQUESTS, Step, sequenced_app, tokens
from tests.support.waiting import wait_until

FAST = dict(decode_base_ms=1.0, decode_per_seq_ms=0.0, prefill_tokens_per_s=1e9)
REQUEST: dict[str, Any] = dict(model="m", messages=[{"role": "user", "content": "Hello there."}],
                               max_tokens=16, seed=3, stream_options={"include_usage": True})
SSE = {"Content-Type": "text/event-stream"}
DONE = b"data: [DONE]\n\n"


def gw(urls: dict[str, str], hedge_after_ms: Any = 100, **sections: Any) -> config.Config:
    raw: dict[str, Any] = {
        "auth": {"mode": "open"},
        "backends": [{"name": n, "base_url": u + "/v1", "models": ["m"]} for n, u in urls.items()],
        "slo_classes": [{"name": "chat", "ttft_ms": 500, "tpot_ms": 100,
                         "hedge_after_ms": hedge_after_ms}],
        "retry": {"hedge_budget": 1.0},
        "server": {"access_log": True}}
    raw.update(sections)
    return config.parse(raw, env={})


def late(first_after_s: float, then: list[Step] | None = None) -> Any:
    """An upstream whose first token comes `first_after_s` after the request."""
    return sequenced_app([(200, SSE, [first_after_s, *(then or tokens(3, 0.0)), DONE])])


class Got:
    def __init__(self) -> None:
        self.text = ""
        self.first_at = 0.0  # when the client had its first text (time.monotonic())
        self.usage: Any = None


async def stream(base: str) -> Got:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    got = Got()
    try:
        async for c in await client.chat.completions.create(stream=True, **REQUEST):
            if c.usage is not None:
                got.usage = c.usage
            for ch in c.choices:
                if ch.delta.content and not got.first_at:
                    got.first_at = time.monotonic()
                got.text += ch.delta.content or ""
        return got
    finally:
        await client.close()


async def counters(base: str, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            key = tuple(line.split(f'{label}="', 1)[1].split('"', 1)[0] for label in labels)
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def access(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "slogate.access"]


async def test_a_late_first_token_is_raced_and_the_faster_answer_is_the_clients(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "slogate.access")
    slow, fast = late(3.0), build_sim(SimConfig(**FAST))
    async with serve_app(slow) as slow_url, serve_app(fast) as fast_url:
        unraced = await stream(fast_url)
        async with serve_app(build_app(gw({"slow": slow_url, "fast": fast_url}))) as base:
            t0 = time.monotonic()
            got = await stream(base)
            assert got.text == unraced.text and got.usage == unraced.usage
            assert got.first_at - t0 < 1.0  # not the slow one's 3 s
            # the loser is cancelled at once: its engine sees the disconnect
            await wait_until(lambda: slow[CANCELLED], timeout=2.0, what="the loser cancelled")
            assert slow[CANCELLED][0] - got.first_at < 0.1
            assert await counters(base, "slogate_hedges_total", "slo_class", "result") == {
                ("chat", "won"): 1}
            assert await counters(base, "slogate_upstream_attempts_total", "backend",
                                  "result") == {("slow", "hedge_lost"): 1, ("fast", "ok"): 1}
            prompt = await counters(base, "slogate_hedge_tokens_total", "slo_class", "kind")
            assert prompt == {("chat", "prompt"): unraced.usage.prompt_tokens}
    [rec] = access(caplog)
    assert rec["outcome"] == "ok" and rec["hedge"] == "won" and rec["backend"] == "fast"
    assert [a["result"] for a in rec["attempts"]] == ["hedge_lost"]
    assert 100 <= rec["ms"]["ttft"] < 1000
    [slow_req] = slow[REQUESTS]  # the first attempt, with the request's own id
    assert {k.lower(): v for k, v in slow_req["headers"].items()}["x-request-id"] == \
        rec["request_id"]


async def test_a_first_token_in_time_starts_no_race() -> None:
    other = late(0.0)
    async with serve_app(build_sim(SimConfig(**FAST))) as fast_url, \
            serve_app(other) as other_url:
        async with serve_app(build_app(gw({"fast": fast_url, "other": other_url},
                                          hedge_after_ms=2000))) as base:
            got = await stream(base)
            assert got.text
            assert other[REQUESTS] == []
            assert await counters(base, "slogate_hedges_total", "slo_class", "result") == {}


async def test_when_the_first_attempt_has_its_token_first_the_hedge_is_cancelled(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "slogate.access")
    primary, hedge = late(0.4), late(3.0)
    async with serve_app(primary) as p_url, serve_app(hedge) as h_url:
        async with serve_app(build_app(gw({"primary": p_url, "hedge": h_url}))) as base:
            got = await stream(base)
            assert got.text == "t0 t1 t2 "
            await wait_until(lambda: hedge[CANCELLED], timeout=2.0, what="the hedge cancelled")
            assert hedge[CANCELLED][0] - got.first_at < 0.1
            assert len(hedge[REQUESTS]) == 1
            assert await counters(base, "slogate_hedges_total", "slo_class", "result") == {
                ("chat", "lost"): 1}
            assert await counters(base, "slogate_upstream_attempts_total", "backend",
                                  "result") == {("hedge", "hedge_lost"): 1, ("primary", "ok"): 1}
    [rec] = access(caplog)
    assert rec["hedge"] == "lost" and rec["backend"] == "primary"
    assert rec["ms"]["ttft"] >= 400


async def test_a_first_attempt_that_fails_while_its_hedge_runs_hands_the_answer_over() -> None:
    # the first attempt closes without a token after 0.3 s: the hedge (sent at 0.1 s) answers
    closes = sequenced_app([(200, SSE, [0.3])])
    hedge = late(0.5)
    async with serve_app(closes) as c_url, serve_app(hedge) as h_url:
        async with serve_app(build_app(gw({"closes": c_url, "hedge": h_url}))) as base:
            got = await stream(base)
            assert got.text == "t0 t1 t2 "
            assert len(hedge[REQUESTS]) == 1  # no third request: the hedge was the failover
            assert await counters(base, "slogate_hedges_total", "slo_class", "result") == {
                ("chat", "won"): 1}
            assert await counters(base, "slogate_upstream_attempts_total", "backend",
                                  "result") == {("closes", "closed_before_first_token"): 1,
                                                ("hedge", "ok"): 1}


async def test_a_hedge_that_fails_leaves_the_first_attempt_to_answer() -> None:
    primary = late(0.4)
    broken = sequenced_app([(503, {"Content-Type": "application/json"}, [b'{"error":"x"}'])])
    async with serve_app(primary) as p_url, serve_app(broken) as b_url:
        async with serve_app(build_app(gw({"primary": p_url, "broken": b_url}))) as base:
            got = await stream(base)
            assert got.text == "t0 t1 t2 "
            assert await counters(base, "slogate_hedges_total", "slo_class", "result") == {
                ("chat", "failed"): 1}
            assert await counters(base, "slogate_upstream_attempts_total", "backend",
                                  "result") == {("broken", "http_503"): 1, ("primary", "ok"): 1}


async def test_the_budget_caps_how_many_requests_race() -> None:
    # hedge_budget 0.5: each request earns half a hedge. Round robin sends the 1st and 3rd
    # to the slow replica: the 1st has half a hedge (none), the 3rd one and a half (it races).
    slow = sequenced_app([(200, SSE, [0.4, *tokens(2, 0.0), DONE])])
    async with serve_app(slow) as slow_url, \
            serve_app(build_sim(SimConfig(**FAST))) as fast_url:
        cfg = gw({"slow": slow_url, "fast": fast_url}, retry={"hedge_budget": 0.5})
        async with serve_app(build_app(cfg)) as base:
            for _ in range(3):
                await stream(base)
            assert await counters(base, "slogate_hedges_total", "slo_class", "result") == {
                ("chat", "won"): 1}
            assert await counters(base, "slogate_hedges_skipped_total", "slo_class",
                                  "reason") == {("chat", "budget"): 1}


def test_the_class_setting_is_checked() -> None:
    cfg = gw({"a": "http://127.0.0.1:9"}, hedge_after_ms="auto")
    assert cfg.slo.classes["chat"].hedge_after_ms == "auto"
    with pytest.raises(config.ConfigError, match="auto"):
        gw({"a": "http://127.0.0.1:9"}, hedge_after_ms="soon")
    with pytest.raises(config.ConfigError, match="hedge_budget"):
        gw({"a": "http://127.0.0.1:9"}, retry={"hedge_budget": 2})


async def test_a_messages_stream_races_too_through_the_anthropic_sdk() -> None:
    from anthropic import AsyncAnthropic

    async def answer(base: str) -> str:
        client = AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
        try:
            async with client.messages.stream(model="m", max_tokens=16,
                                              messages=REQUEST["messages"]) as s:
                return "".join([t async for t in s.text_stream])
        finally:
            await client.close()

    slow, fast = build_sim(SimConfig(stall_ms=3000, **FAST)), build_sim(SimConfig(**FAST))
    async with serve_app(slow) as slow_url, serve_app(fast) as fast_url:
        unraced = await answer(fast_url)
        cfg = config.parse({"auth": {"mode": "open"}, "slo_classes": [
            {"name": "chat", "ttft_ms": 500, "tpot_ms": 100, "hedge_after_ms": 100}],
            "retry": {"hedge_budget": 1.0}, "backends": [
                {"name": n, "type": "anthropic", "base_url": u + "/v1", "models": ["m"]}
                for n, u in (("slow", slow_url), ("fast", fast_url))]}, env={})
        async with serve_app(build_app(cfg)) as base:
            t0 = time.monotonic()
            assert await answer(base) == unraced and unraced
            assert time.monotonic() - t0 < 2.0
            assert await counters(base, "slogate_hedges_total", "slo_class", "result") == {
                ("chat", "won"): 1}


async def test_a_hedge_whose_whole_answer_came_before_the_handover_is_relayed_whole() -> None:
    whole = b"".join(s for s in tokens(4, 0.0) if isinstance(s, bytes)) + DONE
    slow, hedge = late(3.0), sequenced_app([(200, SSE, [whole])])  # one write, then its end
    async with serve_app(slow) as slow_url, serve_app(hedge) as hedge_url:
        async with serve_app(build_app(gw({"slow": slow_url, "hedge": hedge_url}))) as base:
            got = await stream(base)
            assert got.text == "t0 t1 t2 t3 "
            assert await counters(base, "slogate_hedges_total", "slo_class", "result") == {
                ("chat", "won"): 1}
