"""Preemption over real loopback sockets: with every slot held by long streams of a class that
asks more than its part, an arrival of a class that asks less, whose turn would come too late
for its TTFT target, takes a running stream's slot at once; the preempted stream pauses and is
continued when the next slot frees, and its client (the official openai SDK) gets the same
answer an unbroken stream gives, with no error. Counted as a preemption and a continuation,
never against the replica's breaker."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import openai
import orjson
import pytest
from openai import AsyncOpenAI

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.waiting import wait_until

MSG = [{"role": "user", "content": "Tell me about rivers."}]
LONG = 150  # tokens of each flooding stream: 10 ms a token, 1.5 s a stream
# a: loose targets, b: a TTFT target a turn behind a's streams would miss by far
CLASSES = {"a": (10000.0, 500.0), "b": (600.0, 200.0)}


def gateway_config(sim_url: str, preemption: bool = True) -> config.Config:
    return config.parse({
        "auth": {"mode": "open"}, "server": {"access_log": True},
        "admission": {"enabled": True, "adaptive_concurrency": False,
                      "preemption": preemption},
        "slo_classes": [{"name": n, "ttft_ms": t, "tpot_ms": p} for n, (t, p) in CLASSES.items()],
        "slo": {"default": "a"},
        "backends": [{"name": "sim", "base_url": sim_url + "/v1", "models": ["m"],
                      "max_concurrency": 2, "continuation": "prefill"}]}, env={})


async def answer(base: str, cls: str, max_tokens: int,
                 first: asyncio.Event | None = None, seen: list[float] | None = None) -> str:
    """The streamed answer's text, through the official SDK (`first` is set at its first
    token; `seen` gets the loop time of its latest token)."""
    client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    text = ""
    try:
        async for c in await client.chat.completions.create(
                model="m", messages=MSG, max_tokens=max_tokens, seed=7, stream=True,
                extra_headers={"x-slo-class": cls}):
            for ch in c.choices:
                text += ch.delta.content or ""
            if text and first is not None:
                first.set()
            if seen is not None:
                seen[:] = [asyncio.get_running_loop().time()]
        return text
    finally:
        await client.close()


async def metrics(base: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


async def flood_then_b(base: str) -> tuple[list[str], str | Exception]:
    """Warm admission up (five streams ended: how long a slot is held is learned), fill both
    slots with long streams of a, then ask for one of b once they stream."""
    for _ in range(6):
        await answer(base, "a", 4)
    started = [asyncio.Event(), asyncio.Event()]
    flood = [asyncio.create_task(answer(base, "a", LONG, e)) for e in started]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
    try:
        b: str | Exception = await asyncio.wait_for(answer(base, "b", 8), 10)
    except Exception as e:  # the SDK's error for a 429
        b = e
    return list(await asyncio.wait_for(asyncio.gather(*flood), 20)), b


async def test_an_arrival_short_of_its_share_takes_a_running_streams_slot(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "slogate.access")
    sim = build_sim(SimConfig(max_batch=2, decode_base_ms=10.0, decode_per_seq_ms=0.0,
                              prefill_tokens_per_s=1e9))
    async with serve_app(sim) as sim_url:
        unbroken = await answer(sim_url, "a", LONG)
        assert len(unbroken) > 100
        async with serve_app(build_app(gateway_config(sim_url))) as base:
            flood, b = await flood_then_b(base)
            assert isinstance(b, str) and b, b
            # both flooding streams end with the unbroken answer: one of them paused
            assert flood == [unbroken, unbroken]
            m = await metrics(base)
            assert m['slogate_admission_preemptions_total{preempted_class="a",slo_class="b"}'] \
                == 1
            assert m['slogate_upstream_attempts_total{backend="sim",result="preempted"}'] == 1
            assert m['slogate_continuations_total{backend="sim",result="ok"}'] == 1
            assert m['slogate_backend_breaker_state{backend="sim"}'] == 0
            decided = {k: v for k, v in m.items()
                       if k.startswith("slogate_admission_decisions_total")
                       and 'reason="preempted"' in k}
            assert list(decided.values()) == [1] and 'slo_class="b"' in next(iter(decided))
    records = [orjson.loads(r.getMessage()) for r in caplog.records
               if r.name == "slogate.access"]
    [paused] = [r for r in records if r.get("attempts")]
    assert paused["outcome"] == "ok" and paused["slo_class"] == "a"
    assert [a["result"] for a in paused["attempts"]] == ["preempted"]
    assert paused["continued_from_token"][0] > 0
    assert paused["completion_tokens"] == LONG


async def test_without_preemption_the_arrival_is_refused() -> None:
    sim = build_sim(SimConfig(max_batch=2, decode_base_ms=10.0, decode_per_seq_ms=0.0,
                              prefill_tokens_per_s=1e9))
    async with serve_app(sim) as sim_url, \
            serve_app(build_app(gateway_config(sim_url, preemption=False))) as base:
        flood, b = await flood_then_b(base)
        assert isinstance(b, Exception) and "ttft_infeasible" in str(b), b
        assert len(flood) == 2 and flood[0] == flood[1]
        m = await metrics(base)
        assert not any(k.startswith("slogate_admission_preemptions_total") for k in m)


async def test_a_client_that_leaves_while_its_stream_is_paused_frees_what_it_held(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "slogate.access")
    sim = build_sim(SimConfig(max_batch=2, decode_base_ms=10.0, decode_per_seq_ms=0.0,
                              prefill_tokens_per_s=1e9))
    async with serve_app(sim) as sim_url, \
            serve_app(build_app(gateway_config(sim_url))) as base:
        for _ in range(6):
            await answer(base, "a", 4)
        started = [asyncio.Event(), asyncio.Event()]
        seen: list[list[float]] = [[], []]
        flood = [asyncio.create_task(answer(base, "a", LONG, e, t))
                 for e, t in zip(started, seen, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
        # b's answer is long too: the stream that gave it its slot waits ~1.5 s
        b = asyncio.create_task(answer(base, "b", LONG))
        key = 'slogate_admission_preemptions_total{preempted_class="a",slo_class="b"}'
        await wait_until(lambda: metrics_has(base, key), 10, what="a preemption")
        loop = asyncio.get_running_loop()

        def paused_one() -> tuple[int] | None:
            """The stream without a token for 200 ms (the others stream at 10 ms a token)."""
            now = loop.time()
            return next(((i,) for i, t in enumerate(seen) if now - t[0] > 0.2), None)

        [paused] = await wait_until(paused_one, 5, what="a paused stream")
        flood[paused].cancel()
        other = flood[1 - paused]
        assert len(await asyncio.wait_for(other, 20)) > 100
        assert len(await asyncio.wait_for(b, 20)) > 100
        # nothing left held: a new request goes at once, and nothing is in flight after it
        assert await asyncio.wait_for(answer(base, "a", 4), 10)
        await wait_until(lambda: metrics_value(base, "slogate_requests_in_flight", 0.0), 5,
                         what="no request in flight")
        m = await metrics(base)
        assert m.get('slogate_continuations_total{backend="sim",result="ok"}', 0) == 0
    left = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "slogate.access"]
    [gone] = [r for r in left if r.get("attempts")]
    assert gone["outcome"] == "client_cancelled"
    assert [a["result"] for a in gone["attempts"]] == ["preempted"]


async def test_a_preempted_stream_whose_continuation_is_refused_ends_with_an_error_event(
        ) -> None:
    """A backend configured to continue that refuses to (an engine without
    continue_final_message): the paused stream's client gets an error event in its format,
    not a silent end, and the others are served."""
    sim = build_sim(SimConfig(max_batch=2, decode_base_ms=10.0, decode_per_seq_ms=0.0,
                              prefill_tokens_per_s=1e9, continuation=False))
    async with serve_app(sim) as sim_url, \
            serve_app(build_app(gateway_config(sim_url))) as base:
        for _ in range(6):
            await answer(base, "a", 4)
        started = [asyncio.Event(), asyncio.Event()]

        async def outcome(e: asyncio.Event) -> str | Exception:
            try:
                return await answer(base, "a", LONG, e)
            except openai.APIError as err:
                return err

        flood = [asyncio.create_task(outcome(e)) for e in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
        assert len(await asyncio.wait_for(answer(base, "b", 8), 10)) > 0
        done = await asyncio.wait_for(asyncio.gather(*flood), 20)
        [failed] = [d for d in done if isinstance(d, Exception)]
        assert "paused for another request and could not be continued" in str(failed)
        assert [len(d) > 100 for d in done if isinstance(d, str)] == [True]
        m = await metrics(base)
        assert m['slogate_continuations_total{backend="sim",result="http_400"}'] >= 1
        assert m['slogate_backend_breaker_state{backend="sim"}'] == 0


async def metrics_has(base: str, key: str) -> bool:
    return key in await metrics(base)


async def metrics_value(base: str, key: str, value: float) -> bool:
    return (await metrics(base)).get(key) == value


def test_the_preemption_switch_is_configurable() -> None:
    assert config.parse({"auth": {"mode": "open"}, "backends": [
        {"name": "s", "base_url": "http://127.0.0.1:1/v1"}]}, env={}).admission.preemption
    with pytest.raises(config.ConfigError, match="admission.preemption"):
        config.parse({"auth": {"mode": "open"}, "admission": {"preemption": "yes"},
                      "backends": [{"name": "s", "base_url": "http://127.0.0.1:1/v1"}]},
                     env={})

