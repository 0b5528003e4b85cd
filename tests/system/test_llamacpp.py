"""The real llama.cpp engine (llama-cpp-python server + Gemma-3-270M), no gateway in between.

Pins down what the upstream really sends, byte for byte, so gateway relay tests can
compare against it, and the same engine behind the gateway. Needs scripts/install-llamacpp.sh
(`make test` runs it). Run with -s to see the recorded stream.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest

from tests.support.llamacpp import llamacpp_fixture, llamacpp_server, require_llamacpp
from tests.support.waiting import wait_until

llamacpp = llamacpp_fixture(scope="module")

PROMPT = [{"role": "user", "content": "Count from one to ten."}]


async def test_openai_sdk_streams_several_chunks(llamacpp):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llamacpp.base_url, api_key="unused", max_retries=0)
    try:
        t0 = time.monotonic()
        stream = await client.chat.completions.create(
            model=llamacpp.model, messages=PROMPT, max_tokens=16, stream=True, temperature=0,
        )
        roles, contents, finish, ttft = [], [], None, None
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            assert len(chunk.choices) == 1
            choice = chunk.choices[0]
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                if ttft is None:
                    ttft = time.monotonic() - t0
                contents.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
        total = time.monotonic() - t0
    finally:
        await client.close()
    print(f"\nopenai SDK: {len(contents)} content chunks, ttft {ttft:.3f} s, "
          f"16 tokens in {total:.3f} s: {''.join(contents)!r}")
    assert roles == ["assistant"]
    assert len(contents) >= 3, contents  # text arrives incrementally, not in one piece
    assert "".join(contents).strip()
    assert finish in ("length", "stop")
    if finish == "length":
        assert len(contents) == 16  # one chunk per token (max_tokens honoured)


def _events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n"), raw[-50:]
    return raw[:-2].split(b"\n\n")


async def test_raw_sse_bytes_format(llamacpp):
    """Record the exact wire format: headers, event framing, JSON spacing, first/last events."""
    body = {
        "model": "whatever-the-client-says",
        "messages": PROMPT,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},  # ignored by this server
    }
    reads: list[bytes] = []
    async with aiohttp.ClientSession() as s:
        async with s.post(llamacpp.base_url + "/chat/completions", json=body) as resp:
            assert resp.status == 200
            headers = list(resp.raw_headers)
            async for data in resp.content.iter_any():
                reads.append(data)
    raw = b"".join(reads)
    hdr = {k.decode().lower(): v.decode() for k, v in headers}
    print("\n--- response headers ---")
    for k, v in headers:
        print(f"{k.decode()}: {v.decode()}")
    print(f"--- body: {len(raw)} bytes in {len(reads)} reads ---")
    print(raw.decode())

    # headers
    assert hdr["content-type"] == "text/event-stream; charset=utf-8"
    assert hdr["transfer-encoding"] == "chunked"
    assert "content-length" not in hdr
    assert hdr["cache-control"] == "no-store"
    assert hdr["x-accel-buffering"] == "no"
    assert hdr["server"] == "uvicorn"
    assert "x-request-id" in hdr and "openai-processing-ms" in hdr

    # framing: LF only, one "data: " line per event, blank line between events
    assert b"\r" not in raw
    events = _events(raw)
    for ev in events:
        assert ev.startswith(b"data: ") and b"\n" not in ev, ev
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(ev[len(b"data: "):]) for ev in events[:-1]]

    # JSON: Python json.dumps defaults -> ", " and ": " separators, non-ASCII \u-escaped
    first = events[0][len(b"data: "):]
    assert first.decode() == json.dumps(chunks[0])
    assert list(chunks[0]) == ["id", "model", "created", "object", "choices"]
    assert all(c["id"] == chunks[0]["id"] and c["id"].startswith("chatcmpl-") for c in chunks)
    assert all(c["model"] == body["model"] for c in chunks)  # echoes the request's model
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)

    # role chunk, then one content chunk per token, then an empty-delta finish chunk
    assert chunks[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}]
    last = chunks[-1]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] in ("length", "stop")
    content = [c for c in chunks[1:-1] if c["choices"][0]["delta"].get("content") is not None]
    assert content == chunks[1:-1]
    if last["finish_reason"] == "length":
        assert len(content) == body["max_tokens"]
    # stream_options.include_usage is ignored: no usage chunk, no usage field
    assert all("usage" not in c for c in chunks)


async def test_client_disconnect_stops_generation(llamacpp):
    """A streaming client that goes away stops the generation (checked per token).

    One generation runs at a time (--interrupt_requests False queues the next request),
    so if the abandoned generation kept going, the next request would wait for it.
    """
    long_body = {
        "model": llamacpp.model, "max_tokens": 1500, "stream": True, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a very long story about a cat."}],
    }
    async with aiohttp.ClientSession() as s:
        resp = await s.post(llamacpp.base_url + "/chat/completions", json=long_body)
        n = 0
        async for line in resp.content:
            if line.startswith(b"data: "):
                n += 1
                if n == 4:
                    break
        t_disc = time.monotonic()
        resp.close()  # drops the connection mid-stream

    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        async with s.post(llamacpp.base_url + "/chat/completions", json={
            "model": llamacpp.model, "max_tokens": 2, "stream": False,
            "messages": [{"role": "user", "content": "Hi"}],
        }) as r:
            assert r.status == 200
            await r.json()
    waited = time.monotonic() - t0
    print(f"\nnext request served {waited:.3f} s after the disconnect")
    # 1500 tokens take >= 20 s here (~20-80 ms/token on 2 cores); a stopped generation
    # frees the model at once.
    assert waited < 10, waited
    # the server prints this when it notices the disconnect
    await wait_until(lambda: "Disconnected from client" in llamacpp.log_text(), timeout=5,
                     interval=0.1, what="llama.cpp logging the disconnect")
    assert time.monotonic() - t_disc < 15


async def test_concurrent_requests_are_queued_not_interrupted(llamacpp):
    """With --interrupt_requests False a second stream waits; neither is cut short."""
    async def stream(tag: str) -> tuple[str, int, str | None, float, float]:
        body = {"model": llamacpp.model, "max_tokens": 12, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me about {tag}."}]}
        t0 = time.monotonic()
        first = None
        n, finish = 0, None
        async with aiohttp.ClientSession() as s:
            async with s.post(llamacpp.base_url + "/chat/completions", json=body) as r:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    c = json.loads(line[6:])["choices"][0]
                    if c["delta"].get("content") is not None:
                        n += 1
                        first = first if first is not None else time.monotonic() - t0
                    finish = c["finish_reason"] or finish
        return tag, n, finish, first or 0.0, time.monotonic() - t0

    a, b = await asyncio.gather(stream("cats"), stream("dogs"))
    print(f"\nconcurrent: {a} {b}")
    for tag, n, finish, _, _ in (a, b):
        assert finish == "length" and n == 12, (tag, n, finish)
    # serialised: one stream's first token comes after the other one ended (roughly)
    early, late = sorted((a, b), key=lambda x: x[3])
    assert late[3] >= early[4] * 0.8, (early, late)


async def test_async_context_manager_starts_and_stops():
    require_llamacpp()
    async with llamacpp_server(warmup=False) as srv:
        pid = srv.process.pid
        assert srv.base_url.endswith("/v1")
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.base_url + "/models") as r:
                models = await r.json()
        assert models["data"][0]["id"] == srv.model == "gemma-3-270m"
        print(f"\nserver up in {srv.startup_s:.2f} s")
    assert srv.process.poll() is not None  # reaped
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_through_the_gateway_same_stream_and_recorded_timeline(llamacpp, caplog):
    """The real engine behind the gateway: the openai SDK (sync and async) gets the same text
    as directly, and the gateway records TTFT and counts tokens itself (llama.cpp ignores
    include_usage)."""
    import logging

    from openai import AsyncOpenAI, OpenAI

    from gateway import config
    from gateway.ops.server import build_app
    from tests.support.servers import serve_app

    caplog.set_level(logging.INFO, logger="slogate.access")
    base = llamacpp.base_url  # ends with /v1
    cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": True},
                        "backends": [{"name": "llamacpp", "base_url": base, "provider": "llama.cpp",
                                      "models": [llamacpp.model],
                                      "aliases": {"gemma": llamacpp.model}}]},
                       env={})

    async def collect(url: str, model: str) -> str:
        client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model=model, messages=PROMPT, max_tokens=12, stream=True, temperature=0, seed=7)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        finally:
            await client.close()

    direct = await collect(base, llamacpp.model)
    async with serve_app(build_app(cfg)) as gw:
        via = await collect(gw + "/v1", "gemma")
        # The sync client too, non-streaming (run in a thread: this loop serves the gateway).
        def sync_call() -> str:
            with OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0) as c:
                r = c.chat.completions.create(model="gemma", messages=PROMPT, max_tokens=12,
                                              temperature=0, seed=7)
                return r.choices[0].message.content

        whole = await asyncio.to_thread(sync_call)
    assert direct and via == direct
    assert whole.strip() == direct.strip()
    recs = [json.loads(r.getMessage()) for r in caplog.records if r.name == "slogate.access"]
    stream_rec = next(r for r in recs if r["stream"])
    assert stream_rec["outcome"] == "ok" and stream_rec["model"] == "gemma"
    assert stream_rec["usage_source"] == "counted"
    assert stream_rec["completion_tokens"] == stream_rec["token_events"] > 1
    assert 0 < stream_rec["ms"]["ttft"] <= stream_rec["ms"]["e2e"]
