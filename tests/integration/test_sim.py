"""The built-in engine simulator over real loopback sockets: wire format (official openai SDK and
raw bytes), engine physics (ratios, not absolute timings), faults, disconnects, runtime config."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from backends.sim import SimConfig, build_app, cli as sim_cli, config as sim_config
from tests.support.servers import serve_app
from tests.support.waiting import wait_until

FAST = dict(decode_base_ms=2.0, decode_per_seq_ms=0.0, prefill_tokens_per_s=1e9)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me about rivers."}]}


@contextlib.asynccontextmanager
async def sim(**knobs: Any) -> AsyncIterator[str]:
    cfg = SimConfig(**{**FAST, **knobs})
    async with serve_app(build_app(cfg)) as url:
        try:
            yield url
        finally:
            while _CLIENTS:
                await _CLIENTS.pop().close()


_CLIENTS: list[openai.AsyncOpenAI] = []


def sdk(url: str, api_key: str = "sk-sim") -> openai.AsyncOpenAI:
    """An official SDK client, closed when the enclosing sim() exits."""
    _CLIENTS.append(openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0))
    return _CLIENTS[-1]


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        return await r.json()


async def stats(url: str) -> dict[str, Any]:
    return await get_json(url + "/sim/stats")


class RawStream:
    """A hand-written HTTP/1.1 client: exact bytes, exact timing, abrupt close."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self.headers: dict[str, str] = {}

    @classmethod
    async def open(cls, url: str, body: dict[str, Any], path: str = "/v1/chat/completions",
                   headers: dict[str, str] | None = None) -> RawStream:
        host, port = url.removeprefix("http://").split(":")
        r, w = await asyncio.open_connection(host, int(port))
        data = orjson.dumps(body)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        w.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n{extra}\r\n".encode() + data)
        await w.drain()
        return cls(r, w)

    async def read_headers(self) -> None:
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.lower(): v.strip()
                        for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}

    async def read_chunk(self) -> bytes | None:
        """One chunked-encoding chunk; None at the terminating chunk."""
        size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
        if size == 0:
            await self.reader.readuntil(b"\r\n")
            return None
        data = await self.reader.readexactly(size + 2)
        return data[:-2]

    async def events(self) -> AsyncIterator[tuple[float, bytes]]:
        """(arrival time, event bytes) for each SSE event (data lines and comments)."""
        buf = b""
        while (chunk := await self.read_chunk()) is not None:
            now = time.monotonic()
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                yield now, ev

    def close(self) -> None:
        self.writer.transport.abort()


def is_token(ev: bytes) -> bool:
    return ev.startswith(b"data: {") and (b'"content":"' in ev and b'"content":""' not in ev
                                           or b'"text":"' in ev and b'"text":""' not in ev)


async def stream_times(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
                       ) -> tuple[float, list[float], list[bytes]]:
    """TTFT and per-token arrival times of one raw stream."""
    t0 = time.monotonic()
    rs = await RawStream.open(url, {**body, "stream": True}, headers=headers)
    await rs.read_headers()
    times, evs = [], []
    async for t, ev in rs.events():
        evs.append(ev)
        if is_token(ev):
            times.append(t)
    rs.close()
    return times[0] - t0 if times else float("nan"), times, evs


def itl(times: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


# --- the official SDK ----------------------------------------------------------------------------

async def test_sdk_chat_stream_nonstream_and_usage() -> None:
    async with sim() as url:
        client = sdk(url)
        chunks = [c async for c in await client.chat.completions.create(
            **CHAT, stream=True, max_tokens=8, stream_options={"include_usage": True})]
        first = chunks[0].choices[0].delta
        assert first.role == "assistant" and first.content == ""
        text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(text_chunks) == 8
        finish = chunks[-2].choices[0]
        assert finish.finish_reason == "length" and not finish.delta.content
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 8
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 8
        assert all(c.usage is None for c in chunks[:-1])
        assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].model == "m"
        streamed = "".join(c.choices[0].delta.content for c in text_chunks)

        # no include_usage: no usage chunk, every chunk has a choice
        chunks2 = [c async for c in await client.chat.completions.create(**CHAT, stream=True,
                                                                         max_tokens=8)]
        assert all(c.choices for c in chunks2) and all(c.usage is None for c in chunks2)

        full = await client.chat.completions.create(**CHAT, max_tokens=8)
        assert full.choices[0].message.content == streamed  # determinism: same request, same text
        assert full.choices[0].finish_reason == "length"
        assert full.usage.completion_tokens == 8 and full.object == "chat.completion"

        # no max_tokens: the length is drawn (seeded), and the model stops by itself
        free = await client.chat.completions.create(**CHAT)
        assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens >= 1
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim"]


async def test_sdk_completions_stream_and_nonstream() -> None:
    async with sim() as url:
        client = sdk(url)
        chunks = [c async for c in await client.completions.create(
            model="m", prompt="Once upon a time", stream=True, max_tokens=6,
            stream_options={"include_usage": True})]
        assert all(c.object == "text_completion" for c in chunks)
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        assert len(texts) == 6
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
        full = await client.completions.create(model="m", prompt="Once upon a time", max_tokens=6)
        assert full.choices[0].text == "".join(texts)
        assert full.usage.completion_tokens == 6 and full.usage.prompt_tokens == 4  # 16 bytes / 4


async def test_raw_wire_format_is_vllm_like() -> None:
    async with sim() as url:
        _, _, evs = await stream_times(url, {**CHAT, "max_tokens": 3,
                                             "stream_options": {"include_usage": True}})
        assert evs[-1] == b"data: [DONE]"
        objs = [orjson.loads(ev[6:]) for ev in evs[:-1]]
        for ev, o in zip(evs, objs, strict=False):
            assert ev == b"data: " + orjson.dumps(o)  # compact JSON, one line
            assert set(o) == ({"id", "object", "created", "model", "choices"}
                              | ({"usage"} if not o["choices"] else set()))
        assert objs[0]["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}
        assert objs[4]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                         "finish_reason": "length"}
        assert objs[5]["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}


async def test_headers_sent_before_queueing_and_role_with_first_token() -> None:
    async with sim(max_batch=1) as url:
        busy = await RawStream.open(url, {**CHAT, "stream": True, "max_tokens": 100},
                                    headers={"x-sim-token-delay-ms": "20"})
        await busy.read_headers()
        t0 = time.monotonic()
        queued = await RawStream.open(url, {**CHAT, "stream": True, "max_tokens": 2})
        await asyncio.wait_for(queued.read_headers(), 1)
        assert queued.status == 200
        assert queued.headers["content-type"].startswith("text/event-stream")
        assert time.monotonic() - t0 < 0.5
        assert (await stats(url))["waiting"] == 1
        busy.close()
        first = (await queued.read_chunk()).split(b"\n\n")  # vLLM: role chunk with the first token
        assert b'"role":"assistant"' in first[0] and is_token(first[1])
        queued.close()


# --- physics -----------------------------------------------------------------------------------

async def test_ttft_rises_with_queue_depth() -> None:
    async with sim(max_batch=2, decode_base_ms=3.0) as url:
        body = {**CHAT, "max_tokens": 12}
        results = await asyncio.gather(*[stream_times(url, body) for _ in range(10)])
        ttfts = sorted(r[0] for r in results)
        # 2 run at once, 8 queue behind in pairs: the last pair waits 4 generations of 12 steps
        assert ttfts[-1] > 4 * ttfts[1]
        assert ttfts[-1] > ttfts[7] > ttfts[5] > ttfts[3] > ttfts[1]


async def test_ttft_rises_with_prompt_length() -> None:
    async with sim(prefill_tokens_per_s=200_000.0, prefill_chunk_tokens=4096) as url:
        short, _, _ = await stream_times(url, {**CHAT, "max_tokens": 2})
        long_prompt = {"model": "m", "messages": [{"role": "user", "content": "x" * 120_000}],
                       "max_tokens": 2}
        long, _, _ = await stream_times(url, long_prompt)  # 30k tokens: 150 ms of prefill
        assert long > 5 * short and long > 0.1


async def test_itl_rises_with_batch_size() -> None:
    async with sim(decode_base_ms=2.0, decode_per_seq_ms=0.5) as url:
        body = {**CHAT, "max_tokens": 25}
        _, one, _ = await stream_times(url, body)
        results = await asyncio.gather(*[stream_times(url, body) for _ in range(24)])
        batch_itl = statistics.median(itl(r[1]) for r in results)  # 2 + 24*0.5 = 14 ms vs 2.5 ms
        assert batch_itl > 2.5 * itl(one)


async def test_sim_config_changes_speed_at_runtime() -> None:
    async with sim(decode_base_ms=2.0) as url:
        body = {**CHAT, "max_tokens": 12}
        _, fast, _ = await stream_times(url, body)
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/sim/config",
                              json={"decode_base_ms": 20, "max-batch": 8}) as r:
                assert r.status == 200
                cfg = await r.json()
                assert cfg["decode_base_ms"] == 20.0 and cfg["max_batch"] == 8
            async with s.post(url + "/sim/config", json={"no_such_knob": 1}) as r:
                assert r.status == 400 and "no_such_knob" in (await r.json())["error"]["message"]
            async with s.post(url + "/sim/config", json={"max_batch": 0}) as r:
                assert r.status == 400 and "max_batch" in (await r.json())["error"]["message"]
        _, slow, _ = await stream_times(url, body)
        assert itl(slow) > 4 * itl(fast)


async def test_prefix_cache_skips_shared_prefill() -> None:
    async with sim(prefill_tokens_per_s=100_000.0, prefix_cache_bytes=40_000,
                   prompt_tokens_details=True) as url:
        system = "s" * 40_000  # 10k tokens = 100 ms of prefill
        body = {"model": "m", "max_tokens": 2, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "one"}]}
        cold, _, _ = await stream_times(url, body)
        body["messages"][1]["content"] = "two"
        warm, _, evs = await stream_times(url, body)
        assert cold > 4 * warm
        usage = orjson.loads(evs[-2][6:])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 10_000


# --- determinism -------------------------------------------------------------------------------

async def test_determinism_prompt_hash_and_seed() -> None:
    async with sim() as url:
        client = sdk(url)

        async def text(**kw: Any) -> str:
            r = await client.chat.completions.create(**{**CHAT, "max_tokens": 20, **kw})
            return r.choices[0].message.content

        a, b = await text(), await text()
        other = await text(messages=[{"role": "user", "content": "Something else"}])
        assert a == b and a != other
        s1 = await text(seed=7)
        s2 = await text(seed=7, messages=[{"role": "user", "content": "Something else"}])
        assert s1 == s2 and s1 != await text(seed=8)
    async with sim() as url2:  # another instance, same config: same text (replicas agree)
        r = await sdk(url2).chat.completions.create(**{**CHAT, "max_tokens": 20})
        assert r.choices[0].message.content == a


# --- faults ------------------------------------------------------------------------------------

async def test_fault_stall_and_slow_tokens() -> None:
    async with sim() as url:
        body = {**CHAT, "max_tokens": 4}
        base, _, _ = await stream_times(url, body)
        stalled, _, _ = await stream_times(url, body, {"x-sim-stall-ms": "150"})
        assert stalled >= 0.15 and stalled > base + 0.1
        _, times, _ = await stream_times(url, body, {"x-sim-token-delay-ms": "40"})
        assert itl(times) >= 0.035


async def test_fault_cut_after() -> None:
    async with sim() as url:
        rs = await RawStream.open(url, {**CHAT, "stream": True, "max_tokens": 20},
                                  headers={"x-sim-cut-after": "3"})
        await rs.read_headers()
        evs = []
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            async for _, ev in rs.events():
                evs.append(ev)
        assert sum(map(is_token, evs)) == 3 and b"data: [DONE]" not in evs
        assert not any(b"finish_reason\":\"" in ev for ev in evs)
        rs.close()
        with pytest.raises(openai.APIError):  # the SDK sees a broken stream
            async for _ in await sdk(url).chat.completions.create(
                    **CHAT, stream=True, max_tokens=20, extra_headers={"x-sim-cut-after": "2"}):
                pass
        # non-streaming: connection closed, no response
        with pytest.raises(openai.APIConnectionError):
            await sdk(url).chat.completions.create(**CHAT, max_tokens=20,
                                                   extra_headers={"x-sim-cut-after": "2"})


async def test_fault_error_after() -> None:
    async with sim() as url:
        _, _, evs = await stream_times(url, {**CHAT, "max_tokens": 20}, {"x-sim-error-after": "2"})
        assert sum(map(is_token, evs)) == 2 and evs[-1] == b"data: [DONE]"
        err = orjson.loads(evs[-2][6:])
        assert err == {"error": {"message": err["error"]["message"], "type": "InternalServerError",
                                 "param": None, "code": 500}}
        with pytest.raises(openai.APIError):
            async for _ in await sdk(url).chat.completions.create(
                    **CHAT, stream=True, max_tokens=20, extra_headers={"x-sim-error-after": "1"}):
                pass
        with pytest.raises(openai.InternalServerError):  # non-streaming: a 500 after the tokens
            await sdk(url).chat.completions.create(**CHAT, max_tokens=20,
                                                   extra_headers={"x-sim-error-after": "1"})
        st = await stats(url)
        assert st["running"] == 0 and st["faults"]["error"] == 3


@pytest.mark.parametrize("status,exc", [(429, openai.RateLimitError),
                                        (503, openai.InternalServerError),
                                        (529, openai.InternalServerError),
                                        (500, openai.InternalServerError)])
async def test_fault_status(status: int, exc: type) -> None:
    async with sim() as url:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json={**CHAT, "stream": True},
                              headers={"x-sim-status": str(status),
                                       "x-sim-retry-after": "1.5"}) as r:
                assert r.status == status and r.headers["Retry-After"] == "1.5"
                err = (await r.json())["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
        with pytest.raises(exc):
            await sdk(url).chat.completions.create(**CHAT,
                                                   extra_headers={"x-sim-status": str(status)})
        assert (await stats(url))["submitted"] == 0


async def test_fault_hang_headers_and_first_token_with_pings() -> None:
    async with sim() as url:
        rs = await RawStream.open(url, {**CHAT, "stream": True}, headers={"x-sim-hang": "headers"})
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(rs.reader.read(1), 0.15)
        rs.close()
        await wait_until(lambda: _cancelled(url, "queued", 1), timeout=2.0)

        rs = await RawStream.open(url, {**CHAT, "stream": True},
                                  headers={"x-sim-hang": "first_token", "x-sim-ping-ms": "40"})
        await rs.read_headers()
        assert rs.status == 200
        evs: list[bytes] = []

        async def collect() -> None:
            async for _, ev in rs.events():
                evs.append(ev)

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(collect(), 0.23)
        assert evs and all(ev == b": ping" for ev in evs) and 2 <= len(evs) <= 7
        rs.close()


async def test_fault_role_first_and_forced_output_length() -> None:
    async with sim() as url:
        rs = await RawStream.open(url, {**CHAT, "stream": True, "max_tokens": 50},
                                  headers={"x-sim-role-first": "1", "x-sim-stall-ms": "300",
                                           "x-sim-output-tokens": "5"})
        await rs.read_headers()
        first = await asyncio.wait_for(rs.read_chunk(), 0.2)  # before the stalled first token
        assert b'"delta":{"role":"assistant","content":""}' in first
        evs = [ev async for _, ev in rs.events()]
        assert sum(map(is_token, evs)) == 5 and b'"finish_reason":"stop"' in evs[-2]
        assert not any(b'"role"' in ev for ev in evs)
        rs.close()


async def test_fault_defaults_from_knobs() -> None:
    async with sim(fault_status=503, retry_after_s=2) as url:
        async with aiohttp.ClientSession() as s, \
                s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "2"


# --- disconnects -------------------------------------------------------------------------------

async def _cancelled(url: str, phase: str, n: int) -> bool:
    return (await stats(url))["cancellations"][phase] >= n


async def _close_and_check(url: str, rs: RawStream, phase: str, running: int = 0) -> None:
    t_close = time.monotonic()
    rs.close()
    await wait_until(lambda: _cancelled(url, phase, 1), timeout=1.0)
    st = await stats(url)
    assert st["cancellation_times"][-1]["phase"] == phase
    assert st["cancellation_times"][-1]["monotonic"] - t_close < 0.1
    assert st["running"] == running and st["waiting"] == 0


async def test_disconnect_while_queued() -> None:
    async with sim(max_batch=1) as url:
        busy = await RawStream.open(url, {**CHAT, "stream": True, "max_tokens": 1000})
        await busy.read_headers()
        rs = await RawStream.open(url, {**CHAT, "stream": True})
        await rs.read_headers()
        assert (await stats(url))["waiting"] == 1
        await _close_and_check(url, rs, "queued", running=1)
        busy.close()


async def _running(url: str) -> bool:
    return (await stats(url))["decoding"] == 1


async def test_disconnect_during_prefill() -> None:
    async with sim(prefill_tokens_per_s=20_000.0) as url:  # 10k-token prompt: 0.5 s of prefill
        rs = await RawStream.open(url, {"model": "m", "stream": True, "prompt": "p" * 40_000},
                                  path="/v1/completions")
        await rs.read_headers()
        await wait_until(lambda: _prefilling(url), timeout=2.0)
        await _close_and_check(url, rs, "prefill")


async def _prefilling(url: str) -> bool:
    return (await stats(url))["prefilling"] == 1


async def test_disconnect_during_decode_nonstream_too() -> None:
    async with sim() as url:
        rs = await RawStream.open(url, {**CHAT, "stream": True, "max_tokens": 5000})
        await rs.read_headers()
        assert is_token((await rs.read_chunk()).split(b"\n\n")[1])
        await _close_and_check(url, rs, "decode")
        # a non-streaming request abandoned mid-decode is cancelled too
        rs = await RawStream.open(url, {**CHAT, "max_tokens": 5000})
        await wait_until(lambda: _running(url), timeout=2.0)
        t_close = time.monotonic()
        rs.close()
        await wait_until(lambda: _cancelled(url, "decode", 2), timeout=1.0)
        assert (await stats(url))["cancellation_times"][-1]["monotonic"] - t_close < 0.1


# --- HTTP surface ------------------------------------------------------------------------------

async def test_validation_errors_are_openai_400s() -> None:
    async with sim(max_model_len=1000) as url:
        bad: list[tuple[str, Any, str | None]] = [
            ("/v1/chat/completions", b"{not json", None),
            ("/v1/chat/completions", {"model": "m"}, "messages"),
            ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}},
             "stream_options"),
            ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
            ("/v1/chat/completions", {**CHAT, "n": 2}, "n"),
            ("/v1/chat/completions", {**CHAT, "max_tokens": 999}, "max_tokens"),
            ("/v1/completions", {"model": "m", "prompt": 5}, "prompt"),
            ("/v1/chat/completions", CHAT | {"x": 1}, "x-sim-output-tokens"),
        ]
        async with aiohttp.ClientSession() as s:
            for path, body, param in bad:
                data = body if isinstance(body, bytes) else orjson.dumps(body)
                hdrs = {"x-sim-output-tokens": "lots"} if param == "x-sim-output-tokens" else {}
                async with s.post(url + path, data=data, headers=hdrs) as r:
                    assert r.status == 400, (path, body)
                    err = (await r.json())["error"]
                    assert err["type"] == "BadRequestError" and err["code"] == 400
                    assert err["param"] == param
                    assert err["message"]
        with pytest.raises(openai.BadRequestError):
            await sdk(url).chat.completions.create(model="m", messages=[])


async def test_max_waiting_answers_503() -> None:
    async with sim(max_batch=1, max_waiting=1) as url:
        streams = [await RawStream.open(url, {**CHAT, "stream": True, "max_tokens": 1000})
                   for _ in range(2)]
        for rs in streams:
            await rs.read_headers()
        third = await RawStream.open(url, {**CHAT, "stream": True})
        await third.read_headers()
        assert third.status == 503
        for rs in [*streams, third]:
            rs.close()


async def test_metrics_stats_and_request_log() -> None:
    async with sim(served_model_names=["a", "b"], api_key="sk-sim") as url:
        client = sdk(url)
        await client.chat.completions.create(
            **CHAT, max_tokens=3,
            extra_headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
        async for _ in await client.completions.create(model="m", prompt="hi", max_tokens=3,
                                                       stream=True,
                                                       stream_options={"include_usage": True}):
            pass
        log = await get_json(url + "/sim/requests")
        assert [e["path"] for e in log] == ["/v1/chat/completions", "/v1/completions"]
        assert log[0]["headers"]["authorization"] == "Bearer sk-sim"
        assert log[0]["headers"]["traceparent"].startswith("00-111")
        assert log[1]["body"]["stream_options"] == {"include_usage": True}
        with pytest.raises(openai.AuthenticationError):
            await sdk(url, api_key="wrong").models.list()
        assert [m.id for m in (await client.models.list()).data] == ["a", "b"]
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            async with s.get(url + "/health") as r:
                assert r.status == 200
        for name in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc",
                     'vllm:prompt_tokens_total{engine="0",model_name="a"} 7.0',
                     'vllm:generation_tokens_total{engine="0",model_name="a"} 6.0',
                     'sim_cancellations_total{phase="queued"} 0.0', "sim_requests_total 2.0",
                     "vllm:time_to_first_token_seconds_bucket"]:
            assert name in text
        st = await stats(url)
        assert st["completed"] == 2
        assert st["cancellations"] == {"queued": 0, "prefill": 0, "decode": 0}


async def test_instances_are_independent() -> None:
    async with sim() as u1, sim() as u2:
        await sdk(u1).chat.completions.create(**CHAT, max_tokens=2)
        assert (await stats(u1))["completed"] == 1 and (await stats(u2))["completed"] == 0
        async with aiohttp.ClientSession() as s, s.get(u2 + "/metrics") as r:
            assert "sim_requests_total 0.0" in await r.text()


def test_cli_knobs() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    sim_cli.add_arguments(parser)
    args = parser.parse_args(["--port", "1", "--decode-base-ms", "2", "--max-batch", "1024",
                              "--prefill-tokens-per-s", "1e9", "--served-model-name", "x,y",
                              "--role-first", "--hang", "first_token", "--linger-ms", "50",
                              "--no-terminator", "--stall-rate", "0.5", "--error-type",
                              "overloaded_error", "--no-continuation"])
    cfg = sim_cli.config_from_args(args)
    assert (cfg.linger_ms, cfg.no_terminator, cfg.stall_rate) == (50.0, True, 0.5)
    assert cfg.error_type == "overloaded_error" and not cfg.continuation
    assert (cfg.decode_base_ms, cfg.max_batch, cfg.prefill_tokens_per_s) == (2.0, 1024, 1e9)
    assert cfg.served_model_names == ["x", "y"] and cfg.role_first and cfg.hang == "first_token"
    assert cfg.mean_output_tokens == SimConfig().mean_output_tokens
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-batch", "many"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--error-type", "teapot"])


# --- stream ends: linger, no terminator, an error before any output ----------------------------

ANTHROPIC = {"anthropic-version": "2023-06-01"}
# per format: route, body, extra headers, the terminal event's start
FORMATS: dict[str, tuple[str, dict[str, Any], dict[str, str], bytes]] = {
    "chat": ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, {},
             b"data: [DONE]"),
    "completions": ("/v1/completions", {"model": "m", "prompt": "hi"}, {}, b"data: [DONE]"),
    "messages": ("/v1/messages", CHAT, ANTHROPIC, b"event: message_stop"),
    # max_output_tokens ends it: response.incomplete is the terminal event then
    "responses": ("/v1/responses", {"model": "m", "input": "hi"}, {},
                  b"event: response.incomplete"),
}


async def raw_stream(url: str, fmt: str, headers: dict[str, str],
                     max_tokens: int = 3) -> tuple[list[tuple[float, bytes]], float]:
    """(arrival time, event) of a whole stream that ends cleanly, and when its body ended."""
    path, body, extra, _ = FORMATS[fmt]
    limit = "max_output_tokens" if fmt == "responses" else "max_tokens"
    rs = await RawStream.open(url, {**body, "stream": True, limit: max_tokens}, path,
                              {"X-Request-Id": "same", **extra, **headers})
    await rs.read_headers()
    assert rs.status == 200
    evs = [(t, ev) async for t, ev in rs.events()]  # a truncated body raises here
    ended = time.monotonic()
    rs.close()
    return evs, ended


@pytest.mark.parametrize("fmt", ["chat", "messages", "responses"])
async def test_fault_linger_keeps_the_body_open_after_the_terminal_event(fmt: str) -> None:
    async with sim() as url:
        evs, ended = await raw_stream(url, fmt, {"x-sim-linger-ms": "300"})
        terminal = FORMATS[fmt][3]
        assert evs[-1][1].startswith(terminal)
        assert ended - evs[-1][0] >= 0.25
        assert (await stats(url))["faults"]["linger"] == 1


def _timeless(ev: bytes) -> bytes:
    return re.sub(rb'"created(_at)?":\d+', b"", ev)


@pytest.mark.parametrize("fmt", list(FORMATS))
async def test_fault_no_terminator_ends_the_body_cleanly_without_the_terminal_event(
        fmt: str) -> None:
    async with sim() as url:
        evs, _ = await raw_stream(url, fmt, {"x-sim-no-terminator": "1"})
        whole, _ = await raw_stream(url, fmt, {})
    got, want = [_timeless(ev) for _, ev in evs], [_timeless(ev) for _, ev in whole]
    assert want[-1].startswith(FORMATS[fmt][3])
    assert got == want[:-1]  # everything but the terminal event: finish, usage, closing events
    if fmt == "chat":
        assert b'"finish_reason":"length"' in got[-2] and b'"usage"' in got[-1]


async def test_fault_no_terminator_after_an_error() -> None:
    async with sim(no_terminator=True) as url:
        evs, _ = await raw_stream(url, "chat", {"x-sim-error-after": "1"})
    assert b'"InternalServerError"' in evs[-1][1] and is_token(evs[-2][1])


@pytest.mark.parametrize("fmt", list(FORMATS))
async def test_fault_error_before_any_output(fmt: str) -> None:
    """x-sim-error-after: 0: a 200 whose first event after the opening ones is the error."""
    async with sim() as url:
        evs, _ = await raw_stream(url, fmt, {"x-sim-error-after": "0"})
    kinds = [ev.split(b"\n")[0] for _, ev in evs]
    if fmt in ("chat", "completions"):
        assert kinds[1] == b"data: [DONE]" and len(kinds) == 2
        assert orjson.loads(evs[0][1][6:])["error"]["type"] == "InternalServerError"
    elif fmt == "messages":
        assert kinds == [b"event: message_start", b"event: ping", b"event: error"]
        assert orjson.loads(evs[2][1].split(b"data: ")[1])["error"]["type"] == "api_error"
    else:
        assert kinds == [b"event: response.created", b"event: response.in_progress",
                         b"event: error", b"event: response.failed"]


async def test_fault_error_type_overloaded() -> None:
    async with sim() as url:
        hdrs = {"x-sim-error-after": "0", "x-sim-error-type": "overloaded_error"}
        evs, _ = await raw_stream(url, "messages", hdrs)
        err = orjson.loads(evs[-1][1].split(b"data: ")[1])
        assert err == {"type": "error", "error": {"type": "overloaded_error",
                                                  "message": "Overloaded"}}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/messages", json={**CHAT, "max_tokens": 3},
                              headers={**ANTHROPIC, **hdrs}) as r:
                assert r.status == 529
                assert (await r.json())["error"]["type"] == "overloaded_error"
            async with s.post(url + "/v1/messages", json={**CHAT, "max_tokens": 3},
                              headers={**ANTHROPIC, "x-sim-error-type": "bad"}) as r:
                assert r.status == 400


# --- context length, in real engines' words ---------------------------------------------------

async def test_context_length_errors_in_vllm_and_anthropic_words() -> None:
    async with sim(max_model_len=100) as url:
        async with aiohttp.ClientSession() as s:
            async def err(path: str, body: dict[str, Any],
                          headers: dict[str, str] | None = None) -> dict[str, Any]:
                async with s.post(url + path, json=body, headers=headers) as r:
                    assert r.status == 400
                    out: dict[str, Any] = (await r.json())["error"]
                    return out

            big = err("/v1/chat/completions", {**CHAT, "max_tokens": 95})
            assert (await big) == {
                "message": "'max_tokens' or 'max_completion_tokens' is too large: 95. This "
                           "model's maximum context length is 100 tokens and your request has 6 "
                           "input tokens (95 > 100 - 6).",
                "type": "BadRequestError", "param": "max_tokens", "code": 400}
            long = await err("/v1/completions", {"model": "m", "prompt": "x" * 400})
            assert long["message"] == (
                "This model's maximum context length is 100 tokens. However, your request has "
                "100 input tokens. Please reduce the length of the input messages.")
            small = await err("/v1/chat/completions", {**CHAT, "max_tokens": 20},
                              {"x-sim-max-model-len": "20"})
            assert "maximum context length is 20 tokens" in small["message"]
            a_long = await err("/v1/messages", {"model": "m", "max_tokens": 1, "messages": [
                {"role": "user", "content": "x" * 404}]}, ANTHROPIC)
            assert a_long == {"type": "invalid_request_error",
                              "message": "prompt is too long: 101 tokens > 100 maximum"}
            a_big = await err("/v1/messages", {**CHAT, "max_tokens": 95}, ANTHROPIC)
            assert a_big["message"] == ("input length and `max_tokens` exceed context limit: "
                                        "6 + 95 > 100, decrease input length or `max_tokens` "
                                        "and try again")
            async with s.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 94}) as r:
                assert r.status == 200


# --- stall rate --------------------------------------------------------------------------------

async def test_fault_stall_rate_stalls_only_a_share_of_requests() -> None:
    async with sim(stall_ms=1.0, stall_rate=0.5) as url:
        async with aiohttp.ClientSession() as s:
            for _ in range(40):
                async with s.post(url + "/v1/chat/completions",
                                  json={**CHAT, "max_tokens": 1}) as r:
                    assert r.status == 200
            stalled = (await stats(url))["faults"]["stall"]
            assert 5 < stalled < 35
            async with s.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1},
                              headers={"x-sim-stall-rate": "2"}) as r:
                assert r.status == 400
        fast, _, _ = await stream_times(url, {**CHAT, "max_tokens": 2},
                                        {"x-sim-stall-ms": "2000", "x-sim-stall-rate": "0"})
        assert fast < 1.0 and (await stats(url))["faults"]["stall"] == stalled


async def test_new_knobs_through_sim_config() -> None:
    async with sim() as url:
        async with aiohttp.ClientSession() as s:
            new = {"linger_ms": 5, "no_terminator": True, "stall_rate": 0.25,
                   "error_type": "overloaded_error", "continuation": False}
            async with s.post(url + "/sim/config", json=new) as r:
                assert r.status == 200 and new.items() <= (await r.json()).items()
            for bad in ({"stall_rate": 1.5}, {"error_type": "nope"}, {"linger_ms": -1}):
                async with s.post(url + "/sim/config", json=bad) as r:
                    assert r.status == 400, bad


def test_every_knob_and_header_is_documented() -> None:
    """backends/sim/README.md's tables name every SimConfig knob's option and every x-sim-*
    header the server reads."""
    root = Path(__file__).resolve().parents[2] / "backends" / "sim"
    readme = (root / "README.md").read_text()
    for name in sim_config.KNOBS:
        assert f"| `{sim_cli._opt(name)}` |" in readme, name
    headers = set(re.findall(r'"(x-sim-[a-z-]+)"', (root / "server.py").read_text()))
    assert len(headers) > 15
    for h in headers:
        assert f"`{h}:" in readme, h
