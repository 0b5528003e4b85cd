"""Connection timing (gateway/transport/connector.py's TimedConnector): a new upstream connection is
stamped on the exchange being sent, a pooled one is not, and nothing is stamped outside a send;
its protocol fails a body whose framing breaks."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from gateway.exchange import Exchange
from gateway.transport.connector import CONNECTING, TimedConnector
from tests.support import hostile
from tests.support.servers import serve_app


async def test_a_new_connection_is_stamped_a_pooled_one_is_not() -> None:
    # What the override relies on: the connector's extension point is still called so.
    assert TimedConnector._create_connection is not aiohttp.TCPConnector._create_connection
    assert "_create_connection" in vars(aiohttp.TCPConnector)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    async with serve_app(app) as base, aiohttp.ClientSession(connector=TimedConnector()) as s:
        first, second = Exchange("/"), Exchange("/")
        for ex in (first, second):
            token = CONNECTING.set(ex)
            try:
                async with s.get(base + "/") as r:
                    assert await r.text() == "ok"
            finally:
                CONNECTING.reset(token)
        assert 0 < first.t_connect_start <= first.t_connect_end
        assert second.t_connect_start == second.t_connect_end == 0  # the pooled connection
        for headers in ({"Connection": "close"}, {}):  # then a new connection, no exchange
            async with s.get(base + "/", headers=headers) as r:
                assert await r.text() == "ok"
        assert second.t_connect_start == 0


async def test_a_body_whose_framing_breaks_fails_its_reader_instead_of_hanging() -> None:
    """aiohttp closes a connection whose body framing breaks mid-way (here a chunk size that
    does not parse) but leaves the body's reader waiting for ever; the connector's protocol
    fails the reader, as a body cut short is failed."""
    plain = aiohttp.TCPConnector()
    assert "_factory" in vars(plain)  # what TimedConnector replaces
    await plain.close()
    raw = hostile.RawUpstream(default=[
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", 0.05, b"zz\r\nnot a chunk\r\n"])
    async with hostile.serve_raw(raw) as base, \
            aiohttp.ClientSession(connector=TimedConnector()) as s:
        async with s.post(base + "/", data=b"{}") as r:
            got = []
            with pytest.raises(aiohttp.ClientPayloadError,
                               match="not completed: HttpProcessingError"):
                async with asyncio.timeout(5):
                    async for chunk in r.content.iter_any():
                        got.append(chunk)
    assert got == [b"abc"]


async def test_a_request_that_finds_the_pool_full_is_counted() -> None:
    """pool_size connections in use: the next request waits for one, and is counted (a pooled
    or a new connection within the limit is not)."""
    assert "_wait_for_available_connection" in vars(aiohttp.BaseConnector)  # the override's hook
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", slow)
    hits: list[int] = []
    connector = TimedConnector(limit=1, on_pool_full=lambda: hits.append(1))
    async with serve_app(app) as base, aiohttp.ClientSession(connector=connector) as s:

        async def get() -> str:
            async with s.get(base + "/") as r:
                return await r.text()

        first = asyncio.create_task(get())
        while not connector._acquired:  # the first request holds the only connection
            await asyncio.sleep(0.001)
        second = asyncio.create_task(get())
        while not hits:
            await asyncio.sleep(0.001)
        release.set()
        assert await first == await second == "ok"
        assert await get() == "ok"  # the pooled connection, free again: not counted
    assert connector.pool_full == 1 and hits == [1]
