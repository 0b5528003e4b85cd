"""The upstream connector: aiohttp's TCPConnector (pool, DNS, TLS, limits) with connect timing,
and connections whose body reader hears when the body's framing breaks.

`_create_connection` is the connector's own extension point (every connector class implements
it), `_factory` the protocol it makes and `_wait_for_available_connection` where a request
waits for a pool that is full (pool_size connections in use: counted); all private:
tests/integration/test_connector.py pins them.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.helpers import _EXC_SENTINEL, set_exception

from gateway.timeline import now_ns

if TYPE_CHECKING:
    from aiohttp.client_reqrep import ClientRequest, ConnectionKey
    from aiohttp.tracing import Trace


class ConnectStamps(Protocol):
    """Where a new connection's timing is written (the request's exchange)."""
    t_connect_start: int
    t_connect_end: int


# The exchange whose upstream request is being sent, set only around `upstream.send` (the
# connector runs in the request's own task, so it sees it; nothing else does).
CONNECTING: ContextVar[ConnectStamps | None] = ContextVar("slogate_connecting", default=None)


class BodyFailingHandler(ResponseHandler):
    """aiohttp's response protocol, except that a body whose framing breaks mid-way (a chunk
    size that does not parse, say) fails the body's reader: aiohttp closes the connection and
    fails the protocol but leaves the reader waiting, so the relay (or a whole-body read)
    would wait for its deadline. Failed, the reader reports a lost connection (UpstreamLost),
    as a body cut short does."""

    def set_exception(self, exc: BaseException,
                      exc_cause: BaseException = _EXC_SENTINEL) -> None:
        payload = self._payload
        if payload is not None and not payload.is_eof() and payload.exception() is None:
            set_exception(payload, aiohttp.ClientPayloadError(  # str(exc) may quote the body
                f"Response payload is not completed: {type(exc).__name__}"), exc)
        super().set_exception(exc, exc_cause)


class TimedConnector(aiohttp.TCPConnector):
    """Stamps a new upstream connection (pool reuse stamps nothing) on the exchange in
    `CONNECTING`: where aiohttp's TraceConfig `on_connection_create_start/end` hooks fire, but
    without the Trace objects, signal sends and URL copies aiohttp then makes on every request
    (~20 µs per request for two hooks that rarely fire)."""

    def __init__(self, *args: Any, on_pool_full: Callable[[], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._factory = functools.partial(BodyFailingHandler,  # type: ignore[assignment]
                                          loop=self._loop)
        self.pool_full = 0  # requests that had to wait for a connection (the pool at its limit)
        self._on_pool_full = on_pool_full

    async def _wait_for_available_connection(self, key: ConnectionKey,
                                             traces: list[Trace]) -> None:
        # Only a request that finds every connection of the pool in use gets here.
        self.pool_full += 1
        if self._on_pool_full is not None:
            self._on_pool_full()
        await super()._wait_for_available_connection(key, traces)

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
