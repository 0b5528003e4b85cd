"""The protocol-level relay (gateway/transport/wire.py): what it relies on in aiohttp,
back-pressure both ways, and a connection that goes back to the pool after a hooked body."""
from __future__ import annotations

import asyncio
import gzip
import re
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.streams import StreamReader
from yarl import URL

from gateway import config
from gateway.ops.server import build_app
from gateway.transport import client as upstream
from gateway.transport.connector import TimedConnector
from gateway.transport.wire import UpstreamBody, _HookedReader
from tests.support import hostile
from tests.support.servers import serve_app
from tests.support.waiting import wait_until


def chunk(i: int, pad: int = 0) -> bytes:
    obj = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": {"content": f"t{i} " + "x" * pad},
                        "finish_reason": None}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def gateway_config(upstream_base: str) -> config.Config:
    return config.parse({"auth": {"mode": "open"}, "server": {"access_log": False},
                         "backends": [{"name": "up", "base_url": upstream_base + "/v1"}]})


def test_hooked_reader_has_the_stream_readers_layout() -> None:
    assert _HookedReader.__slots__ == ()
    assert _HookedReader.__basicsize__ == StreamReader.__basicsize__


class _Transport:
    """Records what a response writes to the client's transport."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, chunks: list[bytes]) -> None:
        self.writes.append(b"".join(chunks))

    def is_closing(self) -> bool:
        return False


class _Protocol:
    def __init__(self) -> None:
        self.transport = _Transport()
        self._paused = False  # what the writer's drain looks at


def _request(app: web.Application | None = None,
             keep_alive: bool = True) -> tuple[web.Request, _Transport]:
    from aiohttp.http_writer import StreamWriter
    from aiohttp.test_utils import make_mocked_request

    proto = _Protocol()
    writer = StreamWriter(proto, asyncio.get_running_loop())  # type: ignore[arg-type]
    headers = {} if keep_alive else {"Connection": "close"}
    request = make_mocked_request("POST", "/v1/chat/completions", headers=headers,
                                  writer=writer, app=app)
    return request, proto.transport


async def test_the_head_and_the_first_bytes_leave_in_one_write() -> None:
    """CoalescedResponse: aiohttp keeps the head until the first body write and sends both in
    one transport write; an empty first write sends the head alone. A plain StreamResponse
    writes its head in prepare, a write of its own (pinned too: if aiohttp changes either,
    this fails before TTFT does)."""
    from gateway.transport.wire import CoalescedResponse

    async def writes(cls: type[web.StreamResponse], first: bytes) -> list[bytes]:
        request, transport = _request()
        resp = cls(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        return transport.writes

    token = chunk(1)
    (one,) = await writes(CoalescedResponse, token)
    assert one.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in one
    assert one.endswith(b"\r\n\r\n%x\r\n%b\r\n" % (len(token), token))
    (head,) = await writes(CoalescedResponse, b"")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    head, body = await writes(web.StreamResponse, token)
    assert head.endswith(b"\r\n\r\n") and body.endswith(token + b"\r\n")


async def test_the_commit_runs_without_the_event_loop() -> None:
    """start_response runs aiohttp's prepare and first write to their end synchronously (the
    relay commits inside the upstream's data_received), more than a socket buffer at once
    too; it would suspend only for an on_response_prepare receiver — the gateway's app has
    none, and one that awaits is caught, not half-run."""
    from gateway.transport.wire import CoalescedResponse, start_response

    request, transport = _request()
    big = b"data: " + b"x" * (256 * 1024) + b"\n\n"
    start_response(CoalescedResponse(headers={"Content-Type": "text/event-stream"}), request, big)
    (one,) = transport.writes  # written before anything could await
    assert one.startswith(b"HTTP/1.1 200 OK\r\n") and one.endswith(big + b"\r\n")

    app = build_app(gateway_config("http://127.0.0.1:9"))
    assert not app.on_response_prepare and all(not sub.on_response_prepare for sub in [
        r.resource._app for r in app.router.routes()  # type: ignore[union-attr]
        if hasattr(r.resource, "_app")])

    async def slow(request: web.Request, response: web.StreamResponse) -> None:
        await asyncio.sleep(0)

    hooked = web.Application()
    hooked.on_response_prepare.append(slow)
    hooked.freeze()
    request, transport = _request(hooked)
    with pytest.raises(RuntimeError, match="suspended"):
        start_response(CoalescedResponse(), request, b"")


def _undated(value: Any) -> Any:
    """`value` with every HTTP Date in it (a head's bytes, a header pair) replaced by '-'."""
    if isinstance(value, (bytes, bytearray)):
        return re.sub(rb"(^|\r\n)Date: [^\r]*", rb"\1Date: -", bytes(value))
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "Date":
        return ("Date", "-")
    if isinstance(value, (tuple, list)):
        return type(value)(_undated(v) for v in value)
    return value


@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("first", [b"", chunk(1), b"data: " + b"x" * 70_000 + b"\n\n"])
async def test_the_gateways_head_is_aiohttps_byte_for_byte(keep_alive: bool,
                                                         first: bytes) -> None:
    """start_response serialises the relay's head itself (aiohttp's prepare costs ~20 µs per
    request): the bytes, the response's and its writer's state after it, and what aiohttp
    writes next (a chunk, the end) are what aiohttp's own prepare and first write give — if
    an aiohttp upgrade changes its head or its bookkeeping, this fails first."""
    from gateway.transport.wire import CoalescedResponse, _plain, prepare_head, start_response

    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache, no-transform",
               "X-Accel-Buffering": "no", "X-Request-Id": "r-1"}
    seen = []
    for ours in ("prepared", "at commit", "aiohttp"):
        request, transport = _request(keep_alive=keep_alive)
        resp = CoalescedResponse(headers=headers)
        assert _plain(resp, request) is request._payload_writer
        if ours == "prepared":  # serialised ahead (when the upstream's head came), sent later
            prepared = prepare_head(resp, request)
            assert prepared is not None and not transport.writes
            start_response(resp, request, first, prepared)
        elif ours == "at commit":
            start_response(resp, request, first)
        else:
            await resp.prepare(request)
            await resp._payload_writer.write(first, drain=False)  # type: ignore[union-attr,call-arg]
        writer = resp._payload_writer
        assert writer is request._payload_writer
        state = (resp.prepared, resp.keep_alive, resp._must_be_empty_body, resp.chunked,
                 list(resp.headers.items()), writer.chunked, writer._headers_written,
                 writer._headers_buf, writer.output_size, writer.buffer_size, writer.length)
        await resp.write(b"more")
        await resp.write_eof()
        # the three heads are a moment apart: the Date they carry may differ by a second
        seen.append(_undated((b"".join(transport.writes), len(transport.writes), state,
                              resp.body_length)))
    assert seen[0] == seen[1] == seen[2]
    assert seen[0][0].startswith(b"HTTP/1.1 200 OK\r\n")


async def test_a_prepared_head_is_dated_when_it_is_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A head serialised a second (or a long prefill) before its first token carries the Date
    of its commit, as aiohttp's would; the upstream's own Date is left as it was."""
    from gateway.transport import wire

    dates = iter(["Wed, 02 Dec 2026 02:00:00 GMT", "Wed, 02 Dec 2026 02:00:07 GMT"])
    monkeypatch.setattr(wire, "rfc822_formatted_time", lambda: next(dates))
    request, transport = _request()
    resp = wire.CoalescedResponse(headers={"Content-Type": "text/event-stream"})
    prepared = wire.prepare_head(resp, request)
    assert prepared is not None
    wire.start_response(resp, request, chunk(1), prepared)
    (sent,) = transport.writes
    assert b"\r\nDate: Wed, 02 Dec 2026 02:00:07 GMT\r\n" in sent
    assert b"02:00:00" not in sent
    assert resp.headers["Date"] == "Wed, 02 Dec 2026 02:00:07 GMT"
    assert sent.endswith(b"\r\n\r\n" + b"%x\r\n%b\r\n" % (len(chunk(1)), chunk(1)))

    request, transport = _request()
    theirs = "Tue, 01 Dec 2026 00:00:00 GMT"
    resp = wire.CoalescedResponse(headers={"Content-Type": "text/event-stream", "Date": theirs})
    prepared = wire.prepare_head(resp, request)
    assert prepared is not None
    wire.start_response(resp, request, b"", prepared)
    assert f"\r\nDate: {theirs}\r\n".encode() in transport.writes[0]


async def test_an_unusual_response_goes_through_aiohttps_prepare() -> None:
    """Anything `_head` does not reproduce is left to aiohttp: a cookie, compression, a
    length, another status, an HTTP/1.0 client, an on_response_prepare receiver."""
    from aiohttp.test_utils import make_mocked_request

    from gateway.transport.wire import CoalescedResponse, _plain

    request, _ = _request()
    changes = [lambda r: r.set_cookie("a", "b"), lambda r: r.enable_compression(),
               lambda r: r.headers.__setitem__("Content-Length", "3"),
               lambda r: r.set_status(201), lambda r: r.enable_chunked_encoding(),
               lambda r: setattr(r, "_keep_alive", False)]
    for change in changes:
        resp = CoalescedResponse()
        change(resp)
        assert _plain(resp, request) is None
    old = make_mocked_request("POST", "/", version=aiohttp.HttpVersion10,
                              writer=request._payload_writer)
    assert _plain(CoalescedResponse(), old) is None

    async def hook(request: web.Request, response: web.StreamResponse) -> None:
        pass

    hooked = web.Application()
    hooked.on_response_prepare.append(hook)
    hooked.freeze()
    request, _ = _request(hooked)
    assert _plain(CoalescedResponse(), request) is None


class Sink:
    def __init__(self, body: UpstreamBody | None = None, pause_after: int = 0) -> None:
        self.data: list[bytes] = []
        self.eof = asyncio.Event()
        self.error: BaseException | None = None
        self.body = body
        self.pause_after = pause_after

    def body_data(self, data: bytes) -> None:
        self.data.append(data)
        if self.body is not None and len(self.data) == self.pause_after:
            self.body.pause()

    def body_eof(self) -> None:
        self.eof.set()

    def body_error(self, exc: BaseException) -> None:
        self.error = exc
        self.eof.set()


async def test_body_goes_to_the_sink_in_order_with_pause_and_resume_and_the_connection_is_reused(
        ) -> None:
    parts = [chunk(i) for i in range(40)]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, p in enumerate(parts):
            await resp.write(p)
            if i % 10 == 9:
                await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/s", handler)
    async with serve_app(app) as base, aiohttp.ClientSession() as s:
        for _ in range(2):  # the second request reuses the pooled connection
            up = await s.post(base + "/s")
            body = UpstreamBody(up)
            sink = Sink(body, pause_after=3)
            body.hook(sink)
            await asyncio.sleep(0.1)
            assert len(sink.data) == 3 and not sink.eof.is_set()  # paused: nothing more
            body.resume()
            await asyncio.wait_for(sink.eof.wait(), 5)
            body.unhook()
            assert type(up.content) is StreamReader
            assert sink.error is None
            assert b"".join(sink.data) == b"".join(parts)
            up.release()
        assert s.connector is not None
        assert sum(len(v) for v in s.connector._conns.values()) == 1


@pytest.mark.parametrize("pause_after", [0, 1])
async def test_a_body_buffered_before_the_hook_reaches_the_sink_whole(pause_after: int) -> None:
    """A gzip'd body that came with its headers: aiohttp inflates it a bounded step at a time,
    a step each time its buffer is read, so reading what was buffered refills it. All of it
    reaches the sink, in order, then its end; also when the sink pauses meanwhile."""
    plain = b"".join(b'data: {"i":%d}\n\n' % i for i in range(20_000))  # ~330 KB inflated
    packed = gzip.compress(plain)
    raw = hostile.RawUpstream(default=[hostile.http_answer(200, [
        ("Content-Encoding", "gzip"), ("Content-Length", str(len(packed)))], packed)])
    async with hostile.serve_raw(raw) as base:
        connector = TimedConnector()
        try:
            up = await upstream.send(connector, upstream.Target(URL(base + "/v1/x")), {}, b"{}",
                                     aiohttp.ClientTimeout(sock_connect=5))
            await asyncio.sleep(0.05)  # all of it here: buffered as far as aiohttp goes
            body = UpstreamBody(up)
            sink = Sink(body, pause_after=pause_after)
            body.hook(sink)
            if pause_after:
                assert len(sink.data) == 1 and not sink.eof.is_set()
                body.resume()
            await asyncio.wait_for(sink.eof.wait(), 5)
            body.unhook()
            assert sink.error is None
            assert b"".join(sink.data) == plain
            up.release()
        finally:
            await connector.close()


async def test_a_client_that_does_not_read_stops_the_upstream() -> None:
    """Back-pressure end to end: while the client reads nothing, the upstream can only write
    what the socket buffers hold; once it reads, everything arrives, byte-exact."""
    sent = [0]
    total = 64 * 1024 * 1024
    piece = chunk(0, pad=16 * 1024)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while sent[0] < total:
            await resp.write(piece)
            sent[0] += len(piece)
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    up_app = web.Application()
    up_app.router.add_post("/v1/chat/completions", handler)
    async with serve_app(up_app) as up, serve_app(build_app(gateway_config(up))) as gw, \
            aiohttp.ClientSession() as s:
        r = await s.post(gw + "/v1/chat/completions",
                         json={"model": "m", "stream": True, "messages": []})
        assert r.status == 200
        await wait_until(lambda: sent[0] > 0, timeout=2.0, what="the upstream writing")
        await asyncio.sleep(0.5)
        stalled_at = sent[0]
        await asyncio.sleep(0.5)
        assert sent[0] == stalled_at, "the upstream kept writing to a client that reads nothing"
        assert stalled_at < total // 2, stalled_at  # socket buffers only, nothing unbounded
        got = 0
        tail = b""
        async for data in r.content.iter_any():
            got += len(data)
            tail = (tail + data)[-64:]
        assert tail.endswith(DONE)
        assert got == sent[0] + len(DONE)


async def test_a_bug_in_the_sink_is_the_gateways_error_not_the_upstreams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception while relaying (here: the observer) is raised by the request's coroutine,
    as before the protocol-level relay: an internal error, not a lost upstream connection."""
    from gateway.apis import chat

    calls = [0]
    real = chat.ChatCompletions.observe

    def observe(self, event, route):  # type: ignore[no-untyped-def]
        calls[0] += 1  # the first token, then (the others fit its shape) [DONE]
        if calls[0] == 2:
            raise RuntimeError("observer bug")
        return real(self, event, route)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            await resp.write(chunk(i))
            await asyncio.sleep(0.01)
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    up_app = web.Application()
    up_app.router.add_post("/v1/chat/completions", handler)
    monkeypatch.setattr(chat.ChatCompletions, "observe", observe)
    async with serve_app(up_app) as up, serve_app(build_app(gateway_config(up))) as gw, \
            aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(gw + "/v1/chat/completions",
                              json={"model": "m", "stream": True, "messages": []}) as r:
                await asyncio.wait_for(r.read(), 5)
        async with s.get(gw + "/metrics") as r:
            text = await r.text()
        assert 'outcome="gateway_error"' in text
        assert "upstream_connection_lost" not in text
        async with s.post(gw + "/v1/chat/completions",
                          json={"model": "m", "stream": True, "messages": []}) as r:
            assert (await asyncio.wait_for(r.read(), 5)).endswith(DONE)
