"""The upstream request: HTTP/1.1 written by the gateway on aiohttp's pooled connections.

aiohttp's `ClientSession.post` builds a `ClientRequest` (URL normalisation, a header multidict
with auto headers, a payload object, a writer task on Python < 3.12) and a `ClientResponse` for
every request: ~150 µs of CPU per request on this project's VM, half of what the gateway spends
on its side of the upstream hop (benchmarks: `paired --tokens 2`). The proxy needs much less —
a request line, headers it has already decided and a body that is already bytes — so:

- the connection comes from the replica's aiohttp connector (its pool, DNS cache, TLS, limits,
  connect timeout and connect timing: everything that is not per request stays aiohttp's);
- the request is written in one `transport.write` (request line and Host prepared once per
  replica and path; header names and values checked for CR/LF as aiohttp checks them);
- the answer is parsed by aiohttp's own response protocol (llhttp: status, headers, chunked
  framing, decompression, the parser's size limits), so `status`, `headers` and `content` (the
  body's StreamReader) are aiohttp's objects; the relay hooks that StreamReader as before.

What `TCPConnector.connect` reads of a request for a direct connection (no proxy) is in
`Target`; tests/integration/test_upstream.py pins it against the installed aiohttp.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.http_exceptions import BadStatusLine, HttpProcessingError, LineTooLong
from yarl import URL

from gateway.errors import ResponseTooLarge, UpstreamInvalid, UpstreamLost, UpstreamUnreachable
from gateway.transport.netdiag import describe_connect_error

if TYPE_CHECKING:
    from aiohttp.connector import Connection

# aiohttp's own defaults for a ClientSession (client.py): the response parser's limits.
READ_BUFSIZE = 2**16
MAX_LINE_SIZE = 8190
MAX_FIELD_SIZE = 8190
MAX_HEADERS = 128


# What aiohttp raises when an upstream cannot be reached or its connection is lost: nothing
# above the transport sees these (UpstreamUnreachable, UpstreamLost instead).
UPSTREAM_FAILURES = (TimeoutError, aiohttp.ClientError, OSError)


def invalid(exc: HttpProcessingError) -> UpstreamInvalid:
    """A response head aiohttp's parser refused, in words. aiohttp raises a plain
    HttpProcessingError whose cause is the parser's own error, and its message quotes the
    upstream's bytes: neither reaches the client or the log."""
    cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
    if isinstance(cause, LineTooLong):
        return UpstreamInvalid(f"a response header line over {MAX_FIELD_SIZE} bytes", True)
    if "too many headers" in str(cause.message).lower():
        return UpstreamInvalid(f"more than {MAX_HEADERS} response header lines", True)
    if isinstance(cause, BadStatusLine):
        return UpstreamInvalid("a status line that is not HTTP/1.1 (bytes after the end of an "
                               "answer, such as a body after a 204)")
    return UpstreamInvalid("a response head that is not valid HTTP/1.1")


def lost(exc: BaseException) -> UpstreamLost:
    """A connection lost in the middle of a body, as the gateway names it."""
    error = UpstreamLost(str(exc) or type(exc).__name__)
    error.__cause__ = exc
    return error


class Target:
    """One upstream URL as the connector sees a request to it (host, port, TLS: the pool's
    key), and the start of the request written to it, made once per replica and path."""

    __slots__ = ("url", "host", "port", "ssl", "server_hostname", "proxy", "proxy_auth",
                 "proxy_headers", "connection_key", "head")

    def __init__(self, url: URL) -> None:
        self.url = url
        self.host = url.raw_host or ""
        self.port = url.port
        self.ssl: bool = True  # aiohttp's default: verify certificates
        self.server_hostname: str | None = None
        self.proxy: URL | None = None
        self.proxy_auth: aiohttp.BasicAuth | None = None
        self.proxy_headers: Mapping[str, str] | None = None
        self.connection_key = ConnectionKey(self.host, self.port, url.scheme in ("https", "wss"),
                                            self.ssl, None, None, None, None)
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        if not url.is_default_port():
            netloc += f":{url.port}"
        self.head = f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {netloc}\r\n"

    def is_ssl(self) -> bool:
        return bool(self.connection_key.is_ssl)


class UpstreamResponse:
    """An upstream answer: aiohttp's parsed status and headers, its body reader, and the pooled
    connection (back to the pool on `release` once the body is read; dropped on `close`)."""

    __slots__ = ("status", "reason", "headers", "content", "connection")

    def __init__(self, message: Any, content: aiohttp.StreamReader,
                 connection: Connection) -> None:
        self.status: int = message.code
        self.reason: str = message.reason
        self.headers = message.headers  # CIMultiDictProxy[str]
        self.content = content
        self.connection: Connection | None = connection

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    def release(self) -> None:
        """Back to the pool (aiohttp's connector closes it instead if the body was not read to
        its end or the upstream asked to close)."""
        conn, self.connection = self.connection, None
        if conn is not None:
            conn.release()

    def close(self) -> None:
        conn, self.connection = self.connection, None
        if conn is not None:
            conn.close()


def request_bytes(target: Target, headers: Mapping[str, str], body: bytes) -> bytes:
    """The request as it goes on the wire. A header name or value with CR or LF (a key read
    from a file with its newline, say) is refused, as aiohttp refuses it: it would end the
    header early and let the rest be read as another header."""
    block = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    if block.count("\r") != len(headers) or block.count("\n") != len(headers):
        raise ValueError("Newline or carriage return character detected in an upstream "
                         "request header.")
    return (f"{target.head}{block}Content-Length: {len(body)}\r\n\r\n".encode()
            + body)


async def send(connector: aiohttp.BaseConnector, target: Target, headers: Mapping[str, str],
               body: bytes, timeout: aiohttp.ClientTimeout) -> UpstreamResponse:
    """POST `body` to `target` on a pooled connection and wait for the response headers
    (informational 1xx answers are skipped, as aiohttp skips them). A connect error, or a
    connection lost before the headers, is UpstreamUnreachable; a head the parser refuses
    (malformed, or over its limits) is UpstreamInvalid: aiohttp's exceptions stop here."""
    data = request_bytes(target, headers, body)
    try:
        conn = await connector.connect(target, [], timeout)  # type: ignore[arg-type]
    except UPSTREAM_FAILURES as e:
        raise UpstreamUnreachable(describe_connect_error(e, target.host, target.port)) from None
    try:
        proto = conn.protocol
        assert proto is not None and proto.transport is not None
        proto.set_response_params(read_until_eof=True, auto_decompress=True, read_timeout=None,
                                  read_bufsize=READ_BUFSIZE, max_line_size=MAX_LINE_SIZE,
                                  max_field_size=MAX_FIELD_SIZE, max_headers=MAX_HEADERS)
        proto.transport.write(data)
        while True:
            message, payload = await proto.read()
            if not 100 <= message.code < 200 or message.code == 101:
                break
        return UpstreamResponse(message, payload, conn)
    except UPSTREAM_FAILURES as e:
        conn.close()
        raise UpstreamUnreachable(describe_connect_error(e, target.host, target.port)) from None
    except HttpProcessingError as e:  # aiohttp's own ClientResponse wraps it; this is ours
        conn.close()
        raise invalid(e) from None
    except BaseException:
        conn.close()
        raise


async def read_capped(up: aiohttp.ClientResponse | UpstreamResponse, limit: int) -> bytes:
    """A whole non-streamed body, decompressed (aiohttp >= 3.13.3 inflates in bounded steps),
    or ResponseTooLarge as soon as it passes `limit` decompressed bytes; UpstreamLost when the
    connection is lost before its end."""
    if up.content_length is not None and not up.headers.get("Content-Encoding") \
            and up.content_length > limit:
        raise ResponseTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in up.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise ResponseTooLarge(limit)
            parts.append(chunk)
    except UPSTREAM_FAILURES as e:
        raise lost(e) from None
    return b"".join(parts)


async def read_head(up: UpstreamResponse, limit: int) -> bytes:
    """The body's first `limit` bytes (an error answer passed through): what came before the
    connection was lost, if it was."""
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in up.content.iter_any():
            parts.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
    except UPSTREAM_FAILURES:
        pass  # an error answer cut short: what came is all it said
    return b"".join(parts)[:limit]


async def fetch(session: aiohttp.ClientSession, url: str, timeout_s: float,
                limit: int = 0) -> tuple[int, bytes]:
    """GET `url` with one of the replica's sessions (health checks, engine metrics): its status
    and, with `limit`, its body when the status is 200. A redirect is not followed. Failing to
    reach it is UpstreamUnreachable, a body lost midway UpstreamLost, one over `limit`
    ResponseTooLarge."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url, timeout=timeout, allow_redirects=False) as r:
            body = await read_capped(r, limit) if limit and r.status == 200 else b""
            return r.status, body
    except UPSTREAM_FAILURES as e:
        parts = URL(url)
        raise UpstreamUnreachable(describe_connect_error(e, parts.host or "", parts.port)) \
            from None
