"""The transport-level pieces of the relay: every aiohttp internal it relies on is here.

The relay keeps aiohttp for the server (the client's request, response headers) and for the
upstream request (connection pool, TLS, timing trace, response headers). What it takes over
is the body of a streamed answer, both ways:

- upstream: aiohttp's response protocol (an `asyncio.Protocol` whose `data_received` runs the
  llhttp parser in C, chunked decoding included) delivers the body to the response's
  StreamReader by calling its `feed_data`. `hook` turns that StreamReader into a sink: each
  decoded piece of body goes straight to a callback, inside `data_received`, with no buffer,
  no future and no task switch per read. Back-pressure is the protocol's own
  `pause_reading()` / `resume_reading()` (the parser stops between two pieces of body, the
  transport stops reading the socket). End of body and a lost connection reach the callbacks
  as they reach the StreamReader, and the pooled connection is released at the end of the
  body exactly as before.
- client: once the response headers are out, body bytes are written to the client's transport
  directly (chunk framing done here: one `transport.write` per upstream read), and the client
  protocol's `writing_paused` says when to stop reading upstream.

Everything here is synchronous and allocation-light, the response head included
(`start_response`); the one coroutine per stream (the Relay) only wakes under back-pressure
and at the end. tests/integration/test_wire.py pins the aiohttp
behaviour this relies on, so that an aiohttp upgrade that changes it fails there first.
"""
from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

import aiohttp
from aiohttp import hdrs, web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from aiohttp.http_writer import StreamWriter, _serialize_headers
from aiohttp.streams import StreamReader

from gateway.errors import ClientGone
from gateway.transport.client import UPSTREAM_FAILURES, UpstreamResponse, lost


class BodySink(Protocol):
    """What a hooked response body calls, from inside the upstream protocol's callbacks."""

    def body_data(self, data: bytes) -> None: ...
    def body_eof(self) -> None: ...
    def body_error(self, exc: BaseException) -> None: ...


# What aiohttp raises for a client gone mid-write: it stops here, as ClientGone.
_CLIENT_RESET = (ConnectionResetError, aiohttp.ClientConnectionResetError)


def _lost(exc: BaseException) -> BaseException:
    """An upstream body's failure as the relay sees it: a lost connection is UpstreamLost."""
    return lost(exc) if isinstance(exc, UPSTREAM_FAILURES) else exc


# StreamReader has __slots__ (no instance dict), so the hooked reader finds its sink here;
# an entry lives from `hook` to `unhook`.
_SINKS: dict[StreamReader, BodySink] = {}


class _HookedReader(StreamReader):
    """A StreamReader whose body goes to a sink instead of its buffer. Same layout as
    StreamReader (no slots of its own), so an existing reader can be switched to it and back
    with `__class__`."""

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        if data:
            _SINKS[self].body_data(data)
        return False  # nothing more buffered here: the parser goes on

    def feed_eof(self) -> None:
        super().feed_eof()  # end-of-body callbacks: the pooled connection is released
        sink = _SINKS.get(self)
        if sink is not None:
            sink.body_eof()

    def set_exception(self, exc: BaseException, *args: Any, **kwargs: Any) -> None:
        super().set_exception(exc, *args, **kwargs)
        sink = _SINKS.get(self)
        if sink is not None:
            sink.body_error(_lost(exc))

    # Chunk boundaries are only kept for readers of the buffer (iter_chunks); the sink has
    # none, and keeping them would grow a deque by one entry per chunk of a long stream.
    def begin_http_chunk_receiving(self) -> None:
        pass

    def end_http_chunk_receiving(self) -> None:
        pass


class UpstreamBody:
    """The body of one upstream response, delivered to a sink as it is parsed; reading paused
    and resumed for back-pressure."""

    __slots__ = ("content", "protocol", "paused", "hooked", "outside_parser", "transport_paused",
                 "sink")

    def __init__(self, up: UpstreamResponse) -> None:
        self.content = up.content
        conn = up.connection
        self.protocol = conn.protocol if conn is not None else None
        self.paused = False
        self.hooked = False
        self.outside_parser = False  # delivering what was buffered before the hook
        self.transport_paused = False
        self.sink: BodySink | None = None

    def hook(self, sink: BodySink) -> None:
        """From now on the body goes to `sink`: first what aiohttp has buffered already (it
        came with the headers), then, as it arrives, from inside `data_received`. An ended or
        failed body is reported at once."""
        content = self.content
        exc = content.exception()
        if exc is not None:
            sink.body_error(_lost(exc))
            return
        if type(content) is not StreamReader:  # EMPTY_PAYLOAD: no body at all
            sink.body_eof()
            return
        self.sink = sink
        self._buffered()

    def _buffered(self) -> None:
        """What aiohttp buffered before the hook goes to the sink, then the hook is set (at
        its end, or on `resume` when the sink paused it). Reading the buffer may resume the
        parser, which refills it at once (a compressed body inflates a bounded step at a
        time): it is read again until empty, so that nothing is left behind the hook — the
        tail of a gzip'd stream was, once."""
        content, sink = self.content, self.sink
        assert sink is not None
        self.outside_parser = True
        try:
            while not self.paused and content.exception() is None:
                data = content.read_nowait(-1)
                if not data:
                    break
                sink.body_data(data)
        finally:
            self.outside_parser = False
        if self.paused:
            return
        exc = content.exception()
        if exc is not None:
            sink.body_error(_lost(exc))
        elif content.is_eof():
            sink.body_eof()
        else:
            _SINKS[content] = sink
            content.__class__ = _HookedReader
            self.hooked = True

    def hand_to(self, sink: BodySink) -> None:
        """The body goes on to another sink, as it is (paused or not, hooked or not yet): a
        first-token race's winner, from the probe that read it to the request's relay.
        Switching the reader's class back and forth instead would break aiohttp's chunk
        tracking in the middle of a chunk."""
        self.sink = sink
        if self.hooked:
            _SINKS[self.content] = sink

    def unhook(self) -> None:
        """Back to a plain StreamReader (whatever arrives later is buffered, then dropped with
        the connection)."""
        self.sink = None
        if self.hooked:
            self.hooked = False
            content = self.content
            content.__class__ = StreamReader
            _SINKS.pop(content, None)

    def pause(self) -> None:
        """Stop reading the upstream: the parser stops after the piece of body it is
        delivering, the transport stops reading the socket (TCP flow control does the rest).
        Only from the sink's body_data (the parser's pause flag is reset by the parser when
        the piece it delivers returns; set outside it, it would stop a later read for good).
        Outside the parser (the bytes buffered before the hook) only the transport stops."""
        proto = self.protocol
        if self.paused or proto is None or self.content.is_eof():
            return
        self.paused = True
        if self.outside_parser:
            tr = proto.transport
            if tr is not None:
                self.transport_paused = True
                tr.pause_reading()
        else:
            proto.pause_reading()

    def resume(self) -> None:
        """Read again: what the parser kept back is delivered now, re-entrantly (the sink may
        pause again before this returns); so is the rest of what was buffered before the hook,
        if the sink paused while that was delivered."""
        if not self.paused:
            return
        self.paused = False
        proto = self.protocol
        if proto is not None and proto.transport is not None:
            if self.transport_paused:
                self.transport_paused = False
                proto.transport.resume_reading()
            else:
                proto.resume_reading()
        if not self.hooked and self.sink is not None:
            self._buffered()


class CoalescedResponse(web.StreamResponse):
    """A streamed answer's response whose head aiohttp keeps until the first body write, so that
    the head and the bytes held until commit (the first token) leave in one write: one syscall
    and one segment, not two (a plain StreamResponse writes its head in `prepare`: 18 µs more
    per request). An empty first write sends the head alone."""

    _send_headers_immediately = False


def run_now(coro: Coroutine[Any, Any, Any]) -> None:
    """Run an aiohttp coroutine that cannot suspend to its end, here and now (no task, no loop
    iteration). Suspending would be a bug of ours (its preconditions are pinned in
    tests/integration/test_wire.py), raised as such."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError(f"{getattr(coro, '__qualname__', coro)} suspended")


class PreparedHead:
    """A relay's response head serialised before it is due (`prepare_head`, when the upstream's
    headers arrive), so that the commit — in the read that brings the first token — is one
    write of bytes made already. Only its Date is looked at again then (the second may have
    changed since)."""

    __slots__ = ("resp", "writer", "keep_alive", "data", "date", "date_at")

    def __init__(self, resp: CoalescedResponse, writer: StreamWriter, keep_alive: bool,
                 data: bytes, date: str | None) -> None:
        self.resp = resp
        self.writer = writer
        self.keep_alive = keep_alive
        self.data = data
        self.date = date  # the Date it carries, when the gateway set it (None: the upstream's)
        self.date_at = data.find(b"\r\nDate: ") + 8 if date is not None else -1


def prepare_head(resp: CoalescedResponse, request: web.Request) -> PreparedHead | None:
    """Serialise `resp`'s head now, for `start_response` to send later: None when it is not a
    response that `_head` writes (aiohttp's prepare will, at the commit). Nothing is sent;
    nothing may be written to the client before it is."""
    writer = _plain(resp, request)
    if writer is None:
        return None
    keep_alive = request.keep_alive
    data, date = _serialise(resp, keep_alive)
    return PreparedHead(resp, writer, keep_alive, data, date)


def start_response(resp: CoalescedResponse, request: web.Request, first: bytes,
                   prepared: PreparedHead | None = None) -> None:
    """Send the response's head with `first` (possibly empty) in one write, synchronously: from
    inside the upstream's `data_received` the first token goes out in the read that brought it,
    not one event-loop iteration later (under load an iteration is a burst of other streams'
    reads). The relay's answer (a chunked 200 to an HTTP/1.1 POST, nothing aiohttp would add
    but its own headers) is serialised here, as aiohttp would (`_head`), or was already
    (`prepared`, from `prepare_head`); anything else goes through aiohttp's `prepare`, which
    suspends only for on_response_prepare receivers, compression or a headers-sent hook, and
    its writer's `write`, which only suspends to drain (`drain=False` skips it: the relay
    checks the client's buffer itself). ClientGone for a client already gone."""
    try:
        if prepared is not None and prepared.resp is resp and _unsent(resp, prepared.writer):
            _send(prepared, request, first)
            return
        writer = _plain(resp, request)
        if writer is not None:
            _head(resp, request, writer, first)
            return
        run_now(resp.prepare(request))
        payload_writer = resp._payload_writer
        assert payload_writer is not None, "prepared"
        run_now(payload_writer.write(first, drain=False))  # type: ignore[call-arg]
    except _CLIENT_RESET as e:
        raise ClientGone() from e


def _unsent(resp: CoalescedResponse, writer: StreamWriter) -> bool:
    """Nothing of the response (or any other) was written since its head was prepared."""
    return (resp._payload_writer is None and not resp._eof_sent
            and not writer._headers_written and writer.output_size == 0)


def _plain(resp: CoalescedResponse, request: web.Request) -> StreamWriter | None:
    """The request's writer when the response is one that `_head` writes exactly as aiohttp's
    prepare + first write would: not prepared yet, status 200 to an HTTP/1.1 POST (a body,
    chunked), no cookies, compression, explicit chunking or length, keep-alive left to the
    request, no on_response_prepare receiver, and a server writer without hooks that has
    written nothing. None: aiohttp's prepare."""
    writer = request._payload_writer
    if type(writer) is not StreamWriter:
        return None
    match_info = request._match_info
    plain = (resp._payload_writer is None and not resp._eof_sent and resp._status == 200
             and request.method == "POST"
             and request.version == HttpVersion11 and resp._keep_alive is None
             and not resp._cookies and not resp._compression and not resp._chunked
             and resp._length_check and writer._headers_buf is None
             and not writer._headers_written and writer.output_size == 0
             and writer.length is None and writer._compress is None
             and writer._on_chunk_sent is None and writer._on_headers_sent is None
             and hdrs.CONTENT_LENGTH not in resp._headers
             and (match_info is None
                  or not any(app.on_response_prepare for app in match_info._apps)))
    return writer if plain else None


def _head(resp: CoalescedResponse, request: web.Request, writer: StreamWriter,
          first: bytes) -> None:
    """aiohttp's StreamResponse._prepare_headers, _write_headers and its writer's first chunked
    write, for a `_plain` response, in one transport write; the response and its writer are
    left as aiohttp leaves them (prepared, chunked, the head written), so aiohttp's write and
    write_eof, and the server's keep-alive, go on from there. Pinned byte for byte against
    aiohttp's own in tests/integration/test_wire.py."""
    keep_alive = request.keep_alive
    data, date = _serialise(resp, keep_alive)
    _send(PreparedHead(resp, writer, keep_alive, data, date), request, first)


def _serialise(resp: CoalescedResponse, keep_alive: bool) -> tuple[bytes, str | None]:
    """The head of a `_plain` response as aiohttp's _prepare_headers and _write_headers make
    it (its headers completed as they complete them), and the Date set here (None: the
    response had one)."""
    headers = resp._headers
    headers[hdrs.TRANSFER_ENCODING] = "chunked"
    headers.setdefault(hdrs.CONTENT_TYPE, "application/octet-stream")
    date = None
    if hdrs.DATE not in headers:
        date = headers[hdrs.DATE] = rfc822_formatted_time()
    headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
    if hdrs.CONNECTION not in headers and not keep_alive:
        headers[hdrs.CONNECTION] = "close"
    return _serialize_headers(f"HTTP/1.1 200 {resp._reason}", headers), date


def _send(head: PreparedHead, request: web.Request, first: bytes) -> None:
    """Write a serialised head with `first` as the body's first chunk (none when empty), and
    leave the response and its writer as aiohttp's prepare and first write leave them."""
    resp, writer, data = head.resp, head.writer, head.data
    if head.date is not None:
        date = rfc822_formatted_time()  # (aiohttp's, computed once a second)
        if date != head.date:  # a second later than when the head was made
            at = head.date_at
            resp._headers[hdrs.DATE] = head.date = date
            data = head.data = data[:at] + date.encode() + data[at + len(date):]
    if first:
        data += b"%x\r\n%b\r\n" % (len(first), first)
    resp._req = request
    resp._payload_writer = writer
    resp._keep_alive = head.keep_alive
    resp._must_be_empty_body = False
    writer.chunked = True
    writer._headers_written = True
    transport = writer.transport
    if transport is None or transport.is_closing():
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
    writer.buffer_size += len(data)
    writer.output_size += len(data)
    transport.write(data)


async def write(resp: web.StreamResponse, data: bytes) -> None:
    """A write to the client through aiohttp's response (outside the relay's fast path)."""
    try:
        await resp.write(data)
    except _CLIENT_RESET as e:
        raise ClientGone() from e


async def write_eof(resp: web.StreamResponse) -> None:
    try:
        await resp.write_eof()
    except _CLIENT_RESET as e:
        raise ClientGone() from e


class ClientWire:
    """Body bytes to the client's transport, after aiohttp sent the response headers."""

    __slots__ = ("transport", "protocol", "chunked", "writer")

    def __init__(self, request: web.Request, resp: web.StreamResponse) -> None:
        self.transport = request.transport
        self.protocol = request.protocol
        self.chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
        self.writer = resp._payload_writer  # its drain() waits on the protocol's resume

    @property
    def closing(self) -> bool:
        tr = self.transport
        return tr is None or tr.is_closing()

    def send(self, data: bytes) -> bool:
        """Write `data` (framed as one chunk when the response is chunked). False when the
        client's transport is gone or closing: nothing was written. The caller must not
        write an empty `data` (a zero-length chunk ends the body)."""
        tr = self.transport
        if tr is None or tr.is_closing():
            return False
        tr.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        return True

    @property
    def full(self) -> bool:
        """The client's write buffer is over its high-water mark (the transport paused the
        protocol's writing)."""
        return bool(self.protocol.writing_paused)

    async def drain(self) -> None:
        """Wait until the client has taken enough that writing may go on; ClientGone when its
        connection is lost."""
        writer = self.writer
        if writer is not None:
            try:
                await writer.drain()
            except (ConnectionError, aiohttp.ClientConnectionResetError) as e:
                raise ClientGone() from e

