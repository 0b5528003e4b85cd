"""How a stream ends, for the client and in the telemetry: complete at its terminal event or at
a clean EOF once every choice has finished; a client that leaves after that is no cancellation;
an attempt's result says how it ended (upstream_attempts_total{result})."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from gateway import config
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.upstreams import CANCELLED, REQUESTS, Step, scripted_app, tokens
from tests.support.waiting import wait_until

MSG = [{"role": "user", "content": "hello"}]
CHUNK = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
         b'"choices":[{"index":%d,"delta":{%s},"finish_reason":%s}]}\n\n')
USAGE = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
         b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n')
DONE = b"data: [DONE]\n\n"


def finish(index: int = 0, reason: str = "stop") -> bytes:
    return CHUNK % (index, b"", b'"%s"' % reason.encode())


def gw(up: str, **sections: Any) -> config.Config:
    raw: dict[str, Any] = {"auth": {"mode": "open"}, "server": {"access_log": True},
                           "backends": [{"name": "a", "base_url": up + "/v1", "models": ["m"]}]}
    raw.update(sections)
    return config.parse(raw, env={})


def access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "slogate.access"]


async def one_record(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    await wait_until(lambda: access_records(caplog), what="the access-log line")
    [rec] = access_records(caplog)
    return rec


async def attempts(base: str) -> dict[str, float]:
    """slogate_upstream_attempts_total by result."""
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("slogate_upstream_attempts_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[result] = out.get(result, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def sdk_text(base: str, **kw: Any) -> str:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    try:
        parts = []
        stream = await client.chat.completions.create(model="m", stream=True, messages=MSG, **kw)
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
        return "".join(parts)
    finally:
        await client.close()


# -- complete without the terminator -------------------------------------------------------------

async def test_a_complete_answer_without_done_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """Every token, the finish reason and the usage the gateway asked for, then EOF without
    `data: [DONE]`: the SDK raises nothing, the usage is kept, the outcome is ok."""
    caplog.set_level(logging.INFO, logger="slogate.access")
    up = scripted_app(tokens(3, 0.0) + [finish(), USAGE])
    async with serve_app(up) as up_url, serve_app(build_app(gw(up_url))) as base:
        assert await sdk_text(base) == "t0 t1 t2 "
        rec = await one_record(caplog)
        results = await attempts(base)
    assert up[REQUESTS][0]["body"]["stream_options"] == {"include_usage": True}  # asked for
    assert rec["outcome"] == "ok" and "error_type" not in rec and "interruption" not in rec
    assert rec["completion_tokens"] == 2 and rec["usage_source"] == "upstream"
    assert results == {"ok": 1}


@pytest.mark.parametrize("script,why", [
    (tokens(3, 0.0), "no finish reason"),
    (tokens(3, 0.0) + [finish()], "the usage the gateway asked for never came"),
    (tokens(3, 0.0) + [finish(0), USAGE], "one of two choices never finished"),
])
async def test_an_answer_cut_short_still_ends_with_the_error_event(
        caplog: pytest.LogCaptureFixture, script: list[Step], why: str) -> None:
    caplog.set_level(logging.INFO, logger="slogate.access")
    up = scripted_app(script)
    n = 2 if "two choices" in why else 1
    async with serve_app(up) as up_url, serve_app(build_app(gw(up_url))) as base, \
            aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions", json={
                "model": "m", "stream": True, "messages": MSG, "n": n}) as r:
            body = await r.read()
        rec = await one_record(caplog)
        results = await attempts(base)
    assert b"stream_truncated" in body, why
    assert rec["outcome"] == "upstream_truncated", why
    assert results == {"cut": 1}, why


async def test_every_choice_finished_is_complete(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="slogate.access")
    script: list[Step] = tokens(2, 0.0) + [finish(0), finish(1), USAGE]
    up = scripted_app(script)
    async with serve_app(up) as up_url, serve_app(build_app(gw(up_url))) as base, \
            aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions", json={
                "model": "m", "stream": True, "messages": MSG, "n": 2}) as r:
            body = await r.read()
        rec = await one_record(caplog)
    assert b"error" not in body and rec["outcome"] == "ok"
    assert rec["finish_reasons"] == ["stop", "stop"]


# -- an upstream that lingers after its terminal event --------------------------------------------

def lingering(linger_s: float) -> list[Step]:
    return tokens(3, 0.0) + [finish(), USAGE, DONE, linger_s]


async def test_the_answer_ends_at_done_even_if_the_upstream_lingers(
        caplog: pytest.LogCaptureFixture) -> None:
    """The upstream waits 3 s after `[DONE]` before it closes (vLLM behind a proxy does): the
    client's stream ends at `[DONE]`, and so do e2e and the outcome."""
    caplog.set_level(logging.INFO, logger="slogate.access")
    up = scripted_app(lingering(3.0))
    async with serve_app(up) as up_url, serve_app(build_app(gw(up_url))) as base, \
            aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(base + "/v1/chat/completions",
                          json={"model": "m", "stream": True, "messages": MSG}) as r:
            body = await r.read()  # to the end of the response
        elapsed = time.monotonic() - t0
        rec = await one_record(caplog)
        results = await attempts(base)
    assert body.endswith(DONE) and elapsed < 1.5
    assert rec["outcome"] == "ok" and rec["ms"]["e2e"] < 1500
    assert results == {"ok": 1}


async def test_a_client_that_hangs_up_right_after_done_is_not_cancelled(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="slogate.access")
    up = scripted_app(lingering(3.0))
    async with serve_app(up) as up_url, serve_app(build_app(gw(up_url))) as base:
        reader, writer = await asyncio.open_connection(*base.removeprefix("http://").split(":"))
        body = orjson.dumps({"model": "m", "stream": True, "messages": MSG})
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        await reader.readuntil(b"[DONE]")
        writer.close()  # at once: an impatient load generator
        rec = await one_record(caplog)
    assert rec["outcome"] == "ok" and rec.get("verdict") != "failed"
    assert "cancel_phase" not in rec


async def test_a_lingering_upstream_connection_is_pooled_once_its_body_ends() -> None:
    """The terminator's chunk comes 0.1 s after `[DONE]`: the connection still goes back to the
    pool (the next request reuses it); one that lingers past the grace is dropped instead."""
    peers: list[object] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for step in lingering(0.1):
            if isinstance(step, bytes):
                await resp.write(step)
            else:
                await asyncio.sleep(step)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    async with serve_app(app) as up_url, serve_app(build_app(gw(up_url))) as base:
        for _ in range(2):
            assert await sdk_text(base) == "t0 t1 t2 "
    assert peers[0] is peers[1]


async def test_an_upstream_lingering_past_the_grace_is_closed() -> None:
    up = scripted_app(lingering(30.0))
    async with serve_app(up) as up_url, serve_app(build_app(gw(up_url))) as base:
        assert await sdk_text(base) == "t0 t1 t2 "
        await wait_until(lambda: up[CANCELLED], timeout=3.0, what="the upstream dropped")


# -- what each attempt came to ----------------------------------------------------------------

@pytest.mark.parametrize("script,status,timeouts,result", [
    (tokens(3, 0.0) + [finish(), USAGE, DONE], 200, {}, "ok"),
    (tokens(3, 0.0), 200, {}, "cut"),
    (tokens(3, 0.01) + [5.0] + [DONE], 200, {"idle_s": 0.3}, "stalled"),
    # before any token: a failed attempt, tried again (one replica: up to max_attempts)
    ([b'data: {"error":{"message":"boom","type":"server_error"}}\n\n', DONE], 200, {},
     {"in_band_error": 3}),
    ([b'{"error":{"message":"too long","code":"context_length_exceeded"}}'], 400, {},
     "context_length"),
    ([b'{"error":{"message":"flagged by the content policy","code":"content_filter"}}'],
     400, {}, "http_400"),
    ([b'data: {"error":{"message":"bad","type":"BadRequestError","code":400}}\n\n', DONE],
     200, {}, "in_band_error"),  # the request's own error in band: passed on, not retried
])
async def test_attempt_results_say_how_the_attempt_ended(
        script: list[Step], status: int, timeouts: dict[str, float],
        result: str | dict[str, int]) -> None:
    headers = None if status == 200 else {"Content-Type": "application/json"}
    up = scripted_app(script, status=status, headers=headers)
    async with serve_app(up) as up_url, \
            serve_app(build_app(gw(up_url, timeouts=timeouts))) as base, \
            aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions",
                          json={"model": "m", "stream": True, "messages": MSG}) as r:
            await r.read()
        assert await attempts(base) == (result if isinstance(result, dict) else {result: 1})


# -- a whole (non-streamed) answer cut short -------------------------------------------------------

async def test_a_whole_answer_cut_short_fails_over(caplog: pytest.LogCaptureFixture) -> None:
    """The first replica promises 1,000 bytes of JSON and closes after 20: nothing reached the
    client yet, so the next replica answers (before: a 500 from the gateway)."""
    caplog.set_level(logging.INFO, logger="slogate.access")

    async def cut(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json",
                                           "Content-Length": "1000"})
        await resp.prepare(request)
        await resp.write(b'{"id":"c","choices":[')
        assert request.transport is not None
        request.transport.close()
        return resp

    cutting = web.Application()
    cutting.router.add_post("/{tail:.*}", cut)
    whole = (b'{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index"'
             b':0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
             b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')
    good = scripted_app([whole], headers={"Content-Type": "application/json"})
    async with serve_app(cutting) as bad_url, serve_app(good) as good_url:
        cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": True},
                            "retry": {"backoff_base_s": 0.0},
                            "backends": [{"name": "a", "base_url": bad_url + "/v1",
                                          "models": ["m"]},
                                         {"name": "b", "base_url": good_url + "/v1",
                                          "models": ["m"]}]}, env={})
        async with serve_app(build_app(cfg)) as base:
            client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            answers = [await client.chat.completions.create(model="m", messages=MSG)
                       for _ in range(2)]  # round-robin: one of them meets the cut first
            await client.close()
            results = await attempts(base)
        await wait_until(lambda: len(access_records(caplog)) == 2)
    assert [a.choices[0].message.content for a in answers] == ["ok", "ok"]
    assert results["ok"] == 2 and results["cut"] >= 1 and set(results) == {"ok", "cut"}
    assert all(r["outcome"] == "ok" for r in access_records(caplog))
