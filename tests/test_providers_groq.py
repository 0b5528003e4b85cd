"""Groq through the gateway with the official groq SDK: its /openai/v1 paths, and x_groq
timings becoming provider-reported stages (access log, Prometheus)."""
from __future__ import annotations

import asyncio
import re

from groq import AsyncGroq

from provider_stack import assert_provider_stages, stack

MESSAGES = [{"role": "user", "content": "Say hello."}]
ROUTE = "/openai/v1/chat/completions"


def groq_stack(**kw):
    return stack("groq", "/openai/v1", backend={"provider": "groq"}, **kw)


def client(base: str) -> AsyncGroq:
    return AsyncGroq(base_url=base, api_key="gsk-client", max_retries=0)


async def test_stream_x_groq_timings_become_provider_stages() -> None:
    # One sequence at a time: the second request waits for the first, so Groq's queue_time
    # is the engine's real queueing, not a constant.
    async with groq_stack(sim={"max_batch": 1, "decode_base_ms": 3.0}) as s:
        c = client(s.gw)

        async def one() -> tuple[str, object]:
            stream = await c.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                     max_tokens=5)
            chunks = [chunk async for chunk in stream]
            assert chunks[0].x_groq.id and chunks[-1].x_groq.id == chunks[0].x_groq.id
            assert all(chunk.system_fingerprint for chunk in chunks)
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            return text, chunks[-1].x_groq.usage

        (text_a, usage_a), (text_b, usage_b) = await asyncio.gather(one(), one())
        await c.close()
        recs = await s.records(2)
        prom = await s.metrics()
        seen = await s.sim_requests()
    assert text_a == text_b and text_a
    assert {r["path"] for r in seen} == {ROUTE}
    by_queue = sorted([usage_a, usage_b], key=lambda u: u.queue_time)
    assert by_queue[1].queue_time >= by_queue[0].prompt_time + by_queue[0].completion_time - 1e-3
    assert by_queue[0].completion_tokens == 5
    for rec in recs:
        assert rec["route"] == ROUTE and rec["completion_tokens"] == 5
        assert_provider_stages(rec, next(u for u in (usage_a, usage_b)
                                if abs(u.queue_time * 1e3 - rec["ms"]["provider_queue"]) < 1e-3))
    for stage in ("queue", "prefill", "decode"):
        assert re.search(rf'slogate_provider_{stage}_seconds_count\{{backend="sim",model="m",'
                         rf'route="{ROUTE}"\}} 2\.0', prom), stage


async def test_whole_response_timings_from_top_level_usage() -> None:
    async with groq_stack() as s:
        c = client(s.gw)
        whole = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        await c.close()
        (rec,) = await s.records()
    assert whole.x_groq.id and whole.usage.completion_tokens == 4
    assert_provider_stages(rec, whole.usage)
