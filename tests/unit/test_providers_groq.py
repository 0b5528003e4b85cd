"""Groq through the gateway with the official groq SDK: its /openai/v1 paths, and x_groq
timings becoming provider-reported stages (access log, Prometheus)."""
from __future__ import annotations

import asyncio
import re

from groq import AsyncGroq

from tests.support.provider_stack import assert_provider_stages, stack

MESSAGES = [{"role": "user", "content": "Say hello."}]
ROUTE = "/openai/v1/chat/completions"


def groq_stack(**kw):
    return stack("groq", "/openai/v1", backend={"provider": "groq"}, **kw)


def client(base: str) -> AsyncGroq:
    return AsyncGroq(base_url=base, api_key="gsk-client", max_retries=0)


async def test_stream_x_groq_timings_become_provider_stages() -> None:
    # One sequence at a time, two requests: the later one waits in the engine's queue until
    # the first is done, and Groq's queue_time says exactly that.
    async with groq_stack(sim={"max_batch": 1, "decode_base_ms": 3.0}) as s:
        c = client(s.gw)

        async def one() -> tuple[str, object]:
            stream = await c.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                     max_tokens=5)
            chunks = [chunk async for chunk in stream]
            groq_id = chunks[0].x_groq.id
            assert groq_id and chunks[-1].x_groq.id == groq_id
            assert all(chunk.system_fingerprint for chunk in chunks)
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            return text, groq_id, chunks[-1].x_groq.usage

        answers = await asyncio.gather(one(), one())
        await c.close()
        recs = await s.records(2)
        prom = await s.metrics()
        seen = await s.sim_requests()
    assert answers[0][0] == answers[1][0] and answers[0][0]
    assert [r["path"] for r in seen] == [ROUTE, ROUTE]
    # The simulator names the Groq request after the gateway's X-Request-Id.
    usage = {groq_id: u for _, groq_id, u in answers}
    first, second = (usage["req_" + r["headers"]["x-request-id"]] for r in seen)
    arrived_later_s = seen[1]["time"] - seen[0]["time"]
    first_done_s = first.queue_time + first.prompt_time + first.completion_time
    # It waited until the first was done; how much past that depends on when the simulator's
    # loop next ran its scheduler (on a busy CI machine, ~10 ms more was seen).
    waited_for_first_s = first_done_s - arrived_later_s
    assert waited_for_first_s - 2e-3 <= second.queue_time <= waited_for_first_s + 0.05
    assert first.completion_tokens == second.completion_tokens == 5
    for rec in recs:
        assert rec["route"] == ROUTE and rec["completion_tokens"] == 5
        queue_ms = rec["ms"]["provider_queue"]
        assert_provider_stages(rec, next(u for u in usage.values()
                                         if abs(u.queue_time * 1e3 - queue_ms) < 1e-3))
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
