"""The upstream connector: aiohttp's TCPConnector (pool, DNS, TLS, limits) with connect timing.

`_create_connection` is the connector's own extension point (every connector class implements
it), but a private one: tests/integration/test_connector.py pins it.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

import aiohttp

from gateway.timeline import now_ns

if TYPE_CHECKING:
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.client_reqrep import ClientRequest
    from aiohttp.tracing import Trace


class ConnectStamps(Protocol):
    """Where a new connection's timing is written (the request's exchange)."""
    t_connect_start: int
    t_connect_end: int


# The exchange whose upstream request is being sent, set only around `upstream.send` (the
# connector runs in the request's own task, so it sees it; nothing else does).
CONNECTING: ContextVar[ConnectStamps | None] = ContextVar("slogate_connecting", default=None)


class TimedConnector(aiohttp.TCPConnector):
    """Stamps a new upstream connection (pool reuse stamps nothing) on the exchange in
    `CONNECTING`: where aiohttp's TraceConfig `on_connection_create_start/end` hooks fire, but
    without the Trace objects, signal sends and URL copies aiohttp then makes on every request
    (~20 µs per request for two hooks that rarely fire)."""

    async def _create_connection(self, req: ClientRequest, traces: list[Trace],
                                 timeout: aiohttp.ClientTimeout) -> ResponseHandler:
        ex = CONNECTING.get()
        if ex is not None:
            ex.t_connect_start = now_ns()
        # The connection's callbacks (its reader, above all) keep the context they were made
        # in for as long as it is pooled: made with the exchange in it, they would pin the
        # request that opened the connection (its body, its answer) for that long.
        outside = CONNECTING.set(None)
        try:
            proto = await super()._create_connection(req, traces, timeout)
        finally:
            CONNECTING.reset(outside)
        if ex is not None:
            ex.t_connect_end = now_ns()
        return proto
