"""The server side of the aiohttp seam: a RequestHandler with a header deadline, and a TCPSite
whose connections get it. aiohttp bounds header size and idle keep-alive time, but has no
deadline for a request's headers (a slowloris client trickles them for ever) and no cap on open
connections; what to refuse and what to answer is the edge's (`ConnectionPolicy`, implemented
by gateway/edge/listener.py), the mechanics are here.

The header deadline is armed when a connection opens and again when the first byte of the next
request on it arrives; disarmed once the request's headers are parsed. When it fires: the
policy's 408 (if any byte of the request came) and close. Bytes of the next request can also
come with the previous one (pipelining: a whole request and the start of the next in one
packet), before it was handled: so the deadline is armed again when a request ends, and
when it fires with no byte since, the parser is asked whether it holds the start of a
request (yes: 408; no: the connection is idle, aiohttp's keep-alive timeout is its limit).
aiohttp's privates used here (`_handle_request`, `_process_keepalive`, `_keepalive_handle`,
`_messages`, `_parser`, `_loop`, the server's `_kwargs`, the site's own attributes) are
pinned by tests/integration/test_hostile.py and tests/integration/test_bad_input.py.
"""
from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, PayloadEncodingError
from aiohttp.web_protocol import RequestHandler

LINGER_S = 2.0  # how long a timed-out connection may still send before it is closed


class ConnectionPolicy(Protocol):
    """What a connection may hold open, and what a refusal says (raw HTTP answers)."""
    header_timeout_s: float

    def admit(self, client: str) -> str | None:
        """None (the connection is counted until `release`), or why it is refused."""
    def release(self, client: str) -> None: ...
    def refused(self, reason: str) -> bytes:
        """Count a refused connection; the answer it gets before it is closed."""
    def timed_out(self, got_bytes: bool) -> bytes | None:
        """Count a header (or idle) timeout; the answer to send when bytes of a request came."""
    def malformed(self, remote: str | None, message: str, status: int) -> bytes:
        """Note a request that could not be parsed (`message`: the parser's, which may quote
        what the client sent); the JSON body of its answer."""


class GuardedHandler(RequestHandler):
    def __init__(self, manager: Any, policy: ConnectionPolicy, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._policy = policy
        self._client: str | None = None  # counted in the policy while set
        # The header deadline: one timer per connection, left running between requests (no
        # call_later and cancel per request); `_since` says whether, and since when, the
        # headers of a request are awaited.
        self._deadline: asyncio.TimerHandle | None = None
        self._since: float | None = None
        self._got_bytes = False  # bytes of the next request arrived (headers incomplete)
        self._after_request = False  # armed at a request's end: bytes of the next may be in
        self._busy = False  # a request is being handled
        self._refused = False  # answered and closing: what the client still sends is dropped

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "unix"
        reason = self._policy.admit(client)
        super().connection_made(transport)
        if reason is not None:
            self._refused = True
            transport.write(self._policy.refused(reason))  # type: ignore[attr-defined]
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
            self._policy.release(self._client)
            self._client = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._busy and data:
            self._got_bytes = True
            if self._since is None or self._after_request:
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
            self._arm()  # the next request may have begun in the packets of this one
            self._after_request = True

    def _process_keepalive(self) -> None:
        """aiohttp's idle timeout closes a connection whose next request has not been parsed
        yet, without a word, even when its first bytes have come: then the request's header
        deadline decides (its 408), however the two timeouts are set."""
        if self._got_bytes and not self._busy:
            self._keepalive_handle = None  # set again when the request ends
            return
        super()._process_keepalive()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse quotes the offending header line
        (a key with a control character, say) in the body and logs a traceback at ERROR. A
        malformed request is the client's doing: the policy's answer, which echoes nothing."""
        if not isinstance(exc, HttpProcessingError) or status >= 500:
            return super().handle_error(request, status, exc, message)
        body = self._policy.malformed(request.remote, str(exc.message), status)
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already")
        resp = web.Response(status=status, content_type="application/json", body=body)
        resp.force_close()
        return resp

    def _arm(self) -> None:
        self._since = self._loop.time()
        self._after_request = False
        if self._deadline is None:
            self._deadline = self._loop.call_later(self._policy.header_timeout_s, self._check)

    def _disarm(self) -> None:
        self._since = None  # the timer, if any, finds nothing awaited and stops

    def _check(self) -> None:
        self._deadline = None
        if self._since is None:
            return
        left = self._since + self._policy.header_timeout_s - self._loop.time()
        if left > 0:  # armed again since this timer was set: the rest of that wait
            self._deadline = self._loop.call_later(left, self._check)
            return
        self._expired()

    def _expired(self) -> None:
        self._since = None
        transport = self.transport
        if self._busy or transport is None or self._messages:
            return
        if self._after_request and not self._got_bytes:
            if not self._request_begun():
                return  # idle between requests: the keep-alive timeout's business
            self._got_bytes = True
        answer = self._policy.timed_out(self._got_bytes)
        if answer is not None:
            transport.write(answer)
            if isinstance(transport, asyncio.WriteTransport) and transport.can_write_eof():
                # Lingering close (nginx's lingering_close): FIN after the 408, then drop what
                # the client still trickles for a moment. Closing at once with its bytes unread
                # would send a reset, and a reset can reach the client before the 408 does.
                transport.write_eof()
                self._refused = True
                self._loop.call_later(LINGER_S, self.force_close)
                return
        self.force_close()


    def _request_begun(self) -> bool:
        """Does the parser hold the start of a request whose headers are incomplete? aiohttp's
        C parser keeps that to itself, but its `feed_eof` tells: it returns the request it had
        begun (or fails on it), and None, changing nothing, when it had none. Asked only when
        the connection is closed if it had one. A request body still being read is not the
        start of a request (lingering reads it)."""
        parser = self._parser
        if parser is None:
            return False
        try:
            return parser.feed_eof() is not None
        except PayloadEncodingError:
            return False
        except Exception:
            return True


class GuardedSite(web.TCPSite):
    """A TCPSite whose connections are GuardedHandlers."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 guard: ConnectionPolicy, **kwargs: Any) -> None:
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
