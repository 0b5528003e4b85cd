"""The listener's own limits: what a hostile client can hold open.

aiohttp bounds header size and idle keep-alive time, but has no deadline for reading a request's
headers (a slowloris client trickles them for ever) and no cap on open connections. Here:

- GuardedHandler, aiohttp's RequestHandler with a header deadline: armed when a connection opens
  and again when the first byte of the next request on it arrives; disarmed once the request's
  headers are parsed. When it fires: 408 (if any byte of the request came) and close.
- ConnectionGuard: open connections in total and per client address. A connection over a cap
  is answered 503 with Retry-After and closed at once, so descriptors stay bounded.
- GuardedSite: a TCPSite whose connections get that handler.
- fd_budget: raises the soft RLIMIT_NOFILE as far as allowed and clamps max_connections so that
  accepting a client can never take the descriptor an upstream connection needs.

The keep-alive idle timeout is aiohttp's own (`keepalive_timeout`); the body deadline is
ingress's (it answers in the client's API format).
"""
from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from gateway.edge import limits

log = logging.getLogger("slogate")


LINGER_S = 2.0  # how long a timed-out connection may still send before it is closed

class ConnectionGuard:
    def __init__(self, max_connections: int, max_per_client: int, header_timeout_s: float,
                 metrics: Any = None) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.by_client: dict[str, int] = {}
        self._rejected = metrics.connections_rejected if metrics is not None else None
        self._gauge = metrics.open_connections if metrics is not None else None
        self.rejected: dict[str, int] = dict.fromkeys(limits.CONNECTION_REASONS, 0)

    def admit(self, client: str) -> str | None:
        """None (and the connection is counted), or why it is refused."""
        if self.open >= self.max_connections:
            return limits.MAX_CONNECTIONS
        n = self.by_client.get(client, 0)
        if self.max_per_client and n >= self.max_per_client:
            return limits.MAX_CONNECTIONS_PER_CLIENT
        self.by_client[client] = n + 1
        self.open += 1
        if self._gauge is not None:
            self._gauge.set(self.open)
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        n = self.by_client.get(client, 1) - 1
        if n > 0:
            self.by_client[client] = n
        else:
            self.by_client.pop(client, None)
        if self._gauge is not None:
            self._gauge.set(self.open)

    def count(self, reason: str) -> None:
        self.rejected[reason] += 1
        if self._rejected is not None:
            self._rejected.labels(reason).inc()


class GuardedHandler(RequestHandler):
    def __init__(self, manager: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._client: str | None = None  # counted in the guard while set
        # The header deadline: one timer per connection, left running between requests (no
        # call_later and cancel per request); `_since` says whether, and since when, the
        # headers of a request are awaited.
        self._deadline: asyncio.TimerHandle | None = None
        self._since: float | None = None
        self._got_bytes = False  # bytes of the next request arrived (headers incomplete)
        self._busy = False  # a request is being handled
        self._refused = False  # answered and closing: what the client still sends is dropped

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "unix"
        reason = self._guard.admit(client)
        super().connection_made(transport)
        if reason is not None:
            self._refused = True
            self._guard.count(reason)
            transport.write(limits.too_many_connections(reason))  # type: ignore[attr-defined]
            self.force_close()
            return
        self._client = client
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._client is not None:
            self._guard.release(self._client)
            self._client = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._busy and data:
            self._got_bytes = True
            if self._since is None:
                self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self._messages:  # headers complete (aiohttp queued the parsed request)
            self._disarm()

    async def _handle_request(  # type: ignore[no-untyped-def]
            self, request, start_time, request_handler):
        self._disarm()
        self._busy = True
        try:
            resp, reset = await super()._handle_request(request, start_time, request_handler)
            if resp.headers.get("Connection", "").lower() == "close" and not reset:
                # e.g. ingress's 408 for a body that never came: no lingering read of it
                self.force_close()
            return resp, reset
        finally:
            self._busy = False
            self._got_bytes = False

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse quotes the offending header line
        (a key with a control character, say) in the body and logs a traceback at ERROR. A
        malformed request is the client's doing: one redacted warning line, and a short JSON
        error that echoes nothing."""
        if not isinstance(exc, HttpProcessingError) or status >= 500:
            return super().handle_error(request, status, exc, message)
        log.warning("malformed request from %s: %s", request.remote,
                    limits.clip(limits.redact(str(getattr(exc, "message", "")).split("\n")[0]),
                                128))
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already")
        resp = web.Response(status=status, content_type="application/json",
                            body=limits.malformed_request(status))
        resp.force_close()
        return resp

    def _arm(self) -> None:
        self._since = self._loop.time()
        if self._deadline is None:
            self._deadline = self._loop.call_later(self._guard.header_timeout_s, self._check)

    def _disarm(self) -> None:
        self._since = None  # the timer, if any, finds nothing awaited and stops

    def _check(self) -> None:
        self._deadline = None
        if self._since is None:
            return
        left = self._since + self._guard.header_timeout_s - self._loop.time()
        if left > 0:  # armed again since this timer was set: the rest of that wait
            self._deadline = self._loop.call_later(left, self._check)
            return
        self._expired()

    def _expired(self) -> None:
        self._since = None
        transport = self.transport
        if self._busy or transport is None or self._messages:
            return
        if self._got_bytes:
            self._guard.count(limits.HEADER_TIMEOUT)
            transport.write(limits.header_timeout(self._guard.header_timeout_s))
            if isinstance(transport, asyncio.WriteTransport) and transport.can_write_eof():
                # Lingering close (nginx's lingering_close): FIN after the 408, then drop what
                # the client still trickles for a moment. Closing at once with its bytes unread
                # would send a reset, and a reset can reach the client before the 408 does.
                transport.write_eof()
                self._refused = True
                self._loop.call_later(LINGER_S, self.force_close)
                return
        else:
            self._guard.count(limits.IDLE_TIMEOUT)
        self.force_close()


class GuardedSite(web.TCPSite):
    """A TCPSite whose connections are GuardedHandlers."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        kwargs = dict(server._kwargs)  # what AppRunner passes to every RequestHandler
        guard = self.guard

        def factory() -> GuardedHandler:
            return GuardedHandler(server, guard, loop=loop, **kwargs)

        self._server = await loop.create_server(
            factory, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)

    @property
    def bound_port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return port


def fd_budget(max_connections: int, upstream_fds: int, reserve: int = 128) -> int:
    """Raise the soft descriptor limit as far as the hard limit allows; return the number of
    client connections that fit next to `upstream_fds` upstream connections and a reserve
    (listening sockets, logs, the event loop's own)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + upstream_fds + reserve
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return max_connections
    fit = max(16, soft - upstream_fds - reserve)
    if fit < max_connections:
        log.warning("max_connections lowered from %d to %d: the descriptor limit is %d "
                    "(raise it with ulimit -n)", max_connections, fit, soft)
        return fit
    return max_connections


def runner_kwargs(server_cfg: Any) -> dict[str, Any]:
    """aiohttp's own per-connection limits."""
    return {"keepalive_timeout": server_cfg.idle_connection_timeout_s,
            "max_line_size": 8190, "max_field_size": 8190, "max_headers": 128,
            "lingering_time": 5.0}


class RedactingFilter(logging.Filter):
    """Credential header values never reach a log line: aiohttp logs a request it could not
    parse with the parser's exception, which quotes the offending header line."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format: keep it as aiohttp made it
            return True
        clean = limits.clip(limits.redact(message), 2048)
        if record.exc_info:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = limits.redact(text)
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = limits.redact(record.exc_text)
        record.msg, record.args = clean, ()
        return True


_FILTER = RedactingFilter()
REDACTED_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.client",
                    "aiohttp.internal", "asyncio", "slogate")


def install_log_redaction() -> None:
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
