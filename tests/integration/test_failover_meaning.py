"""Failures decided by their meaning, and a retry order that wastes no time: a prompt too long
for a model's context goes to its larger-context fallback, other 4xx never move nor judge the
backend, an error in band before the first token fails over, an untried replica is tried at
once (no Retry-After wait), and a committed answer cut short is a failure its breaker hears."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from openai import AsyncOpenAI

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.upstreams import REQUESTS, Answer, sequenced_app, tokens

MSG = [{"role": "user", "content": "hello"}]
SSE = {"Content-Type": "text/event-stream"}
JSON = {"Content-Type": "application/json"}
DONE = b"data: [DONE]\n\n"
FINISH = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
          b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
OK_STREAM: Answer = (200, SSE, [*tokens(3, 0.0), FINISH, DONE])
# vLLM's words for a prompt over the context (a 400, before any stream)
TOO_LONG: Answer = (400, JSON, [
    b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, your '
    b'request has 5000 input tokens. Please reduce the length of the input messages.",'
    b'"type":"BadRequestError","param":"input_tokens","code":400}}'])
POLICY: Answer = (400, JSON, [
    b'{"error":{"message":"Your request was rejected by the content policy.",'
    b'"type":"invalid_request_error","code":"content_policy_violation"}}'])


def gw(backends: list[dict[str, Any]], **sections: Any) -> config.Config:
    raw: dict[str, Any] = {"auth": {"mode": "open"}, "backends": backends}
    raw.update(sections)
    return config.parse(raw, env={})


def backend(name: str, url: str, models: list[str], **kw: Any) -> dict[str, Any]:
    return {"name": name, "base_url": url + "/v1", "models": models, **kw}


async def chat_text(base: str, model: str = "m") -> str:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    try:
        stream = await client.chat.completions.create(model=model, stream=True, messages=MSG)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    finally:
        await client.close()


async def attempts(base: str) -> dict[tuple[str, str], float]:
    """slogate_upstream_attempts_total by (backend, result)."""
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("slogate_upstream_attempts_total{"):
            b = line.split('backend="', 1)[1].split('"', 1)[0]
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[(b, result)] = float(line.rsplit(" ", 1)[1])
    return out


# -- a prompt too long for the model's context ---------------------------------------------------

async def test_context_length_goes_to_the_larger_model() -> None:
    small, large = sequenced_app([TOO_LONG]), sequenced_app([OK_STREAM])
    async with serve_app(small) as s_url, serve_app(large) as l_url:
        cfg = gw([backend("small", s_url, ["m"]), backend("large", l_url, ["m-long"])],
                 fallbacks={"context_length": {"m": ["m-long"]}})
        async with serve_app(build_app(cfg)) as base:
            assert await chat_text(base) == "t0 t1 t2 "
            assert large[REQUESTS][0]["body"]["model"] == "m-long"
            assert await attempts(base) == {("small", "context_length"): 1, ("large", "ok"): 1}


async def test_context_length_without_a_larger_model_passes_through_and_judges_nothing() -> None:
    small, other = sequenced_app([TOO_LONG]), sequenced_app([OK_STREAM])
    async with serve_app(small) as s_url, serve_app(other) as o_url:
        # an ordinary fallback is no larger model: the 400 is the answer
        cfg = gw([backend("small", s_url, ["m"]), backend("other", o_url, ["m2"])],
                 fallbacks={"m": ["m2"]}, breaker={"failures": 1})
        async with serve_app(build_app(cfg)) as base:
            for _ in range(3):  # a breaker that heard these would open after the first
                with pytest.raises(openai.BadRequestError, match="maximum context length"):
                    await chat_text(base)
            assert len(small[REQUESTS]) == 3 and other[REQUESTS] == []


async def test_a_content_policy_refusal_is_never_rerouted() -> None:
    a, b = sequenced_app([POLICY]), sequenced_app([OK_STREAM])
    async with serve_app(a) as a_url, serve_app(b) as b_url:
        cfg = gw([backend("a", a_url, ["m"]), backend("b", b_url, ["m2"])],
                 fallbacks={"m": ["m2"], "context_length": {"m": ["m2"]}},
                 breaker={"failures": 1})
        async with serve_app(build_app(cfg)) as base:
            for _ in range(2):
                with pytest.raises(openai.BadRequestError, match="content policy"):
                    await chat_text(base)
            assert b[REQUESTS] == []
            assert await attempts(base) == {("a", "http_400"): 2}


# -- an error in band before the first token -----------------------------------------------------

OVERLOADED = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
              b'"type":"message","role":"assistant","content":[],"model":"m","usage":'
              b'{"input_tokens":3,"output_tokens":1}}}\n\n'
              b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
              b'"message":"Overloaded"}}\n\n')


async def anthropic_text(base: str) -> str:
    client = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
    try:
        async with client.messages.stream(model="m", max_tokens=8, messages=MSG) as stream:
            return "".join([t async for t in stream.text_stream])
    finally:
        await client.close()


async def test_an_overload_in_band_before_the_first_token_fails_over() -> None:
    busy = sequenced_app([(200, SSE, [OVERLOADED])])
    sim = build_sim(SimConfig(decode_base_ms=1, decode_per_seq_ms=0, output_tokens=8))
    async with serve_app(busy) as busy_url, serve_app(sim) as sim_url:
        cfg = gw([backend("busy", busy_url, ["m"], type="anthropic"),
                  backend("sim", sim_url, ["m"], type="anthropic")])
        async with serve_app(build_app(cfg)) as base:
            direct = anthropic.AsyncAnthropic(base_url=sim_url, api_key="k")
            async with direct.messages.stream(model="m", max_tokens=8, messages=MSG) as st:
                expected = "".join([t async for t in st.text_stream])
            await direct.close()
            texts = [await anthropic_text(base) for _ in range(2)]  # round-robin: busy first
            assert texts == [expected, expected]
            assert await attempts(base) == {("busy", "in_band_error"): 2, ("sim", "ok"): 2}


async def test_an_overload_in_band_with_nowhere_else_to_go_reaches_the_client() -> None:
    busy = sequenced_app([(200, SSE, [OVERLOADED])])
    async with serve_app(busy) as busy_url:
        cfg = gw([backend("busy", busy_url, ["m"], type="anthropic")],
                 retry={"max_attempts": 2, "backoff_base_s": 0.001})
        async with serve_app(build_app(cfg)) as base:
            with pytest.raises(anthropic.APIStatusError, match="Overloaded"):
                await anthropic_text(base)
            assert len(busy[REQUESTS]) == 2


# -- retry order -----------------------------------------------------------------------------------

RATE_LIMITED: Answer = (429, {**JSON, "Retry-After": "30"}, [
    b'{"error":{"message":"slow down","type":"rate_limit_error"}}'])


async def test_an_untried_replica_is_tried_at_once_not_after_retry_after() -> None:
    limited, free = sequenced_app([RATE_LIMITED]), sequenced_app([OK_STREAM])
    async with serve_app(limited) as l_url, serve_app(free) as f_url:
        cfg = gw([backend("limited", l_url, ["m"]), backend("free", f_url, ["m"])],
                 retry={"retry_after_cap_s": 60})
        async with serve_app(build_app(cfg)) as base:
            async with asyncio.timeout(10):  # a wait for the Retry-After would take 30 s
                assert [await chat_text(base) for _ in range(2)] == ["t0 t1 t2 "] * 2
            assert len(limited[REQUESTS]) == 2 and len(free[REQUESTS]) == 2


async def test_retry_after_is_waited_for_only_to_go_back_to_the_same_replica() -> None:
    up = sequenced_app([(429, {**JSON, "Retry-After": "0.2"}, [b'{"error":{}}']), OK_STREAM])
    async with serve_app(up) as url:
        async with serve_app(build_app(gw([backend("a", url, ["m"])]))) as base:
            t0 = asyncio.get_running_loop().time()
            assert await chat_text(base) == "t0 t1 t2 "
            assert asyncio.get_running_loop().time() - t0 >= 0.2
            assert len(up[REQUESTS]) == 2


async def test_a_retry_after_over_the_cap_with_nowhere_else_to_go_is_answered_at_once() -> None:
    up = sequenced_app([RATE_LIMITED])
    async with serve_app(up) as url:
        async with serve_app(build_app(gw([backend("a", url, ["m"])]))) as base:
            async with asyncio.timeout(10):
                with pytest.raises(openai.RateLimitError):
                    await chat_text(base)
            assert len(up[REQUESTS]) == 1


@pytest.mark.parametrize("same_first", [True, False])
async def test_same_replica_first_goes_back_once_after_a_transient_5xx(same_first: bool) -> None:
    flaky = sequenced_app([(500, JSON, [b'{"error":{"message":"hiccup"}}']), OK_STREAM])
    other = sequenced_app([OK_STREAM])
    async with serve_app(flaky) as f_url, serve_app(other) as o_url:
        cfg = gw([backend("flaky", f_url, ["m"]), backend("other", o_url, ["m"])],
                 retry={"same_replica_first": same_first, "backoff_base_s": 0.001})
        async with serve_app(build_app(cfg)) as base:
            assert await chat_text(base) == "t0 t1 t2 "
            assert len(flaky[REQUESTS]) == (2 if same_first else 1)
            assert len(other[REQUESTS]) == (0 if same_first else 1)


# -- a committed answer cut short is the backend's failure ----------------------------------------

async def test_streams_cut_after_commit_open_the_breaker() -> None:
    cut = sequenced_app([(200, SSE, tokens(2, 0.0))])  # a clean EOF mid-answer
    async with serve_app(cut) as url:
        cfg = gw([backend("a", url, ["m"])], breaker={"failures": 2, "cooldown_s": 60})
        async with serve_app(build_app(cfg)) as base:
            for _ in range(2):
                with pytest.raises(openai.APIError, match="before it was complete"):
                    await chat_text(base)
            with pytest.raises(openai.InternalServerError, match="No healthy backend"):
                await chat_text(base)
            assert len(cut[REQUESTS]) == 2
