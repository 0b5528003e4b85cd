"""Connection timing (gateway/transport/connector.py's TimedConnector): a new upstream connection is
stamped on the exchange being sent, a pooled one is not, and nothing is stamped outside a send."""
from __future__ import annotations

import aiohttp
from aiohttp import web

from gateway.exchange import Exchange
from gateway.transport.connector import CONNECTING, TimedConnector
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
