"""The upstream request written by the gateway (gateway/transport/client.py) on aiohttp's pooled
connections: what reaches the upstream, byte for byte; what aiohttp's connector reads of a
request (pinned against the installed aiohttp); pooling, 1xx answers, header injection."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.client_reqrep import ClientRequest
from multidict import CIMultiDict
from yarl import URL

from gateway.errors import UpstreamUnreachable
from gateway.transport import client as upstream
from gateway.transport.connector import TimedConnector
from tests.support import hostile

TIMEOUT = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=5)


def test_target_is_what_aiohttps_connector_reads_of_a_request() -> None:
    """Every attribute TCPConnector reads of a request for a direct connection, with the
    values aiohttp's own ClientRequest has for the same URL (so both share one pool key)."""
    loop = asyncio.new_event_loop()
    try:
        for url in (URL("http://127.0.0.1:8000/v1/chat/completions"),
                    URL("https://api.example.com/v1/messages"), URL("http://[::1]:81/v1/x")):
            target = upstream.Target(url)
            req = ClientRequest("POST", url, loop=loop)
            assert target.connection_key == req.connection_key
            for name in ("host", "port", "ssl", "server_hostname", "proxy", "proxy_auth",
                         "proxy_headers"):
                assert getattr(target, name) == getattr(req, name), name
            assert target.is_ssl() == req.is_ssl()
    finally:
        loop.close()
    assert upstream.Target(URL("https://api.example.com/v1/messages")).head == (
        "POST /v1/messages HTTP/1.1\r\nHost: api.example.com\r\n")
    assert upstream.Target(URL("http://[::1]:81/v1/x?a=%20b")).head == (
        "POST /v1/x?a=%20b HTTP/1.1\r\nHost: [::1]:81\r\n")


async def test_the_request_on_the_wire_and_a_pooled_connection_reused() -> None:
    answer = (b"HTTP/1.1 100 Continue\r\n\r\n"  # skipped, as aiohttp skips it
              b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
    raw = hostile.RawUpstream(default=[answer])
    port = await raw.start()
    seen = raw.seen
    connector = TimedConnector()
    try:
        target = upstream.Target(URL(f"http://127.0.0.1:{port}/v1/chat/completions"))
        headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": "r-1"})
        for _ in range(2):
            up = await upstream.send(connector, target, headers, b'{"a":1}', TIMEOUT)
            assert (up.status, up.headers["Content-Type"], up.content_length) == (
                200, "text/plain", 2)
            assert await up.content.read() == b"ok"
            up.release()
            up.release()  # a second release is harmless
        assert seen == [(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                         "Content-Type: application/json\r\nX-Request-Id: r-1\r\n"
                         'Content-Length: 7\r\n\r\n{"a":1}').encode()] * 2
        assert sum(len(v) for v in connector._conns.values()) == 1  # one connection, reused
    finally:
        await connector.close()
        raw.close()


@pytest.mark.parametrize("name, value", [("X-Key", "abc\r\nX-Evil: 1"), ("X-Key", "abc\n"),
                                         ("X-Evil\r\nA", "b")])
def test_a_header_with_cr_or_lf_is_refused(name: str, value: str) -> None:
    target = upstream.Target(URL("http://127.0.0.1:1/v1/x"))
    with pytest.raises(ValueError, match="Newline or carriage return"):
        upstream.request_bytes(target, CIMultiDict({name: value}), b"")


async def test_a_connection_lost_before_the_headers_is_unreachable_and_not_pooled() -> None:
    raw = hostile.RawUpstream(close_after=[""])  # reads the request, closes without a word
    port = await raw.start()
    connector = TimedConnector()
    try:
        target = upstream.Target(URL(f"http://127.0.0.1:{port}/v1/x"))
        with pytest.raises(UpstreamUnreachable, match="disconnected"):
            await upstream.send(connector, target, CIMultiDict(), b"", TIMEOUT)
        assert sum(len(v) for v in connector._conns.values()) == 0
    finally:
        await connector.close()
        raw.close()


async def test_an_aiohttp_upstream_gets_the_same_request_as_from_aiohttps_client() -> None:
    """Against a real aiohttp server: the headers it sees from upstream.send are the ones
    aiohttp's client sent for the same call (with the gateway's skip_auto_headers)."""
    got: list[dict[str, str]] = []

    async def echo(request: web.Request) -> web.Response:
        got.append(dict(request.headers))
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_post("/v1/x", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = URL(f"http://127.0.0.1:{port}/v1/x")
    headers = CIMultiDict({"Content-Type": "application/json", "Accept": "*/*",
                           "X-Request-Id": "r"})
    try:
        async with aiohttp.ClientSession(skip_auto_headers=("User-Agent", "Accept-Encoding")
                                         ) as s:
            async with s.post(url, data=b"{}", headers=headers) as r:
                assert await r.read() == b"{}"
        connector = TimedConnector()
        up = await upstream.send(connector, upstream.Target(url), headers, b"{}", TIMEOUT)
        assert await up.content.read() == b"{}"
        up.release()
        await connector.close()
        assert got[0] == got[1]
    finally:
        await runner.cleanup()
