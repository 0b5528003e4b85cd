"""A hostile upstream and hostile clients, on real loopback sockets.

The upstream misbehaves by the model name it is asked for:
  flood-line       200 event stream: `data: ` and then bytes without a newline, for ever
  flood-prefirst   200 event stream: role-only chunks (no token), for ever
  flood-after      200 event stream: one token, then a line without a newline, for ever
  flood-json       200 JSON (not compressed) that never ends: an answer over any size limit
  huge-event       200 event stream: one token, then one whole event of 16 MiB (terminated)
  bomb             200 JSON, gzip: ~0.4 MB on the wire, 400 MB inflated
  slow-headers     a status line, then one header trickled a byte per 100 ms, never ended
  reset-before     a TCP reset instead of an answer
  reset-after      200 event stream: one token, then a TCP reset
  redirect         307 to another origin (TRAP counts who follows it, with which headers)
  cookie           200 JSON with Set-Cookie / openai-organization / openai-project, and records
                   the request headers it got
Every "for ever" stops once the gateway stops reading (or after `cap` bytes).

What no HTTP server library would send (a 101, a 204 with a body, oversized headers, a body
shorter than its Content-Length) comes from `RawUpstream`: exact bytes on a bare socket.

`python -m tests.support.hostile --port P` serves it (and its trap) as a process of its own;
GET /health answers once it is ready.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web

from benchmarks.procstat import open_fds, rss_mib  # noqa: F401 (the hostile test reads them here)

SEEN = web.AppKey("seen", list)  # request headers the `cookie` model received
TRAP_HITS = web.AppKey("trap_hits", list)  # requests that followed the redirect
TRAP = web.AppKey("trap", web.Application)

_BOMB: bytes | None = None


def gzip_bomb(inflated_mib: int = 400) -> bytes:
    global _BOMB
    if _BOMB is None:
        c = zlib.compressobj(9, zlib.DEFLATED, 31)
        zeros = b"0" * (1 << 20)
        _BOMB = b"".join(c.compress(zeros) for _ in range(inflated_mib)) + c.flush()
    return _BOMB


def trap_app() -> web.Application:
    app = web.Application()
    app[TRAP_HITS] = []

    async def steal(request: web.Request) -> web.Response:
        app[TRAP_HITS].append(dict(request.headers))
        return web.json_response({"stolen": True})

    app.router.add_route("*", "/{tail:.*}", steal)
    return app


def reset(request: web.Request) -> None:
    """Close the connection with a TCP reset (SO_LINGER 0), not a FIN."""
    transport = request.transport
    assert transport is not None
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def hostile_app(trap_url: str, cap: int = 256 << 20) -> web.Application:
    app = web.Application(client_max_size=1 << 20)
    app[SEEN] = []
    bomb = gzip_bomb()  # made once, before any attack (it takes ~2 s of CPU)
    chunk_64k = b"x" * 65536
    role = b'data: {"id":"h","object":"chat.completion.chunk","choices":[{"index":0,' \
           b'"delta":{"role":"assistant"}}]}\n\n'
    token = b'data: {"id":"h","object":"chat.completion.chunk","choices":[{"index":0,' \
            b'"delta":{"content":"hi"}}]}\n\n'

    async def endless(resp: web.StreamResponse, head: bytes, unit: bytes) -> None:
        await resp.write(head)
        sent = 0
        while sent < cap:
            await resp.write(unit)
            sent += len(unit)

    async def handler(request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = orjson.loads(await request.read())
        model = body.get("model", "")
        if model == "redirect":
            raise web.HTTPTemporaryRedirect(trap_url + "/steal")
        if model == "bomb":
            return web.Response(body=bomb, headers={
                "Content-Type": "application/json", "Content-Encoding": "gzip"})
        if model == "reset-before":
            reset(request)
            raise ConnectionResetError("reset on purpose")
        if model == "slow-headers":
            transport = request.transport
            assert transport is not None
            transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Slow: ")
            for _ in range(600):  # a minute of it, unless the gateway gives up first
                if transport.is_closing():
                    break
                transport.write(b"a")
                await asyncio.sleep(0.1)
            reset(request)
            raise ConnectionResetError("trickled on purpose")
        if model == "flood-json":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await endless(resp, b'{"id":"h","object":"chat.completion","x":"', chunk_64k)
            await resp.write_eof()
            return resp
        if model == "cookie":
            app[SEEN].append(dict(request.headers))
            return web.Response(body=orjson.dumps({"id": "c", "object": "chat.completion",
                                                   "choices": []}), headers={
                "Content-Type": "application/json", "Set-Cookie": "session=upstream-secret",
                "openai-organization": "org-upstream", "openai-project": "proj-upstream",
                "x-ratelimit-remaining-requests": "99"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if model == "flood-line":
                await endless(resp, b"data: ", chunk_64k)
            elif model == "flood-prefirst":
                await endless(resp, b"", role * 512)
            elif model == "flood-after":
                await endless(resp, role + token + b"data: ", chunk_64k)
            elif model == "huge-event":
                await resp.write(role + token + b'data: {"x":"')
                for _ in range(256):  # 16 MiB, then the event's end
                    await resp.write(chunk_64k)
                await resp.write(b'"}\n\n')
            elif model == "reset-after":
                await resp.write(role + token)
                await asyncio.sleep(0.01)
                reset(request)
                return resp
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", handler)
    return app


# -- an upstream on a bare socket -----------------------------------------------------------

RawStep = bytes | float  # bytes: write them (one write); float: sleep that many seconds


class RawUpstream:
    """An upstream that answers each request with the exact bytes of `answers[model]` (or
    `default`, or a callable of the request's JSON body), on a bare TCP socket. The connection
    is kept for the next request unless the model is in `close_after`.

    `seen`: each request's bytes (head and body); `requests`: (connection number, model) of
    each; `closed`: the connections the gateway closed (EOF while waiting for a request)."""

    def __init__(self, answers: Mapping[str, Sequence[RawStep]] | None = None, *,
                 default: Sequence[RawStep] | Callable[[dict[str, Any]], Sequence[RawStep]]
                 = (), close_after: Sequence[str] = ()) -> None:
        self.answers = answers or {}
        self.default = default
        self.close_after = frozenset(close_after)
        self.seen: list[bytes] = []
        self.requests: list[tuple[int, str]] = []
        self.closed: list[int] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def _script(self, body: dict[str, Any]) -> tuple[str, Sequence[RawStep]]:
        model = str(body.get("model", ""))
        if model in self.answers:
            return model, self.answers[model]
        return model, self.default(body) if callable(self.default) else self.default

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed.append(number)
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                data = await reader.readexactly(length)
                self.seen.append(head + data)
                try:
                    body = orjson.loads(data) if data else {}
                except orjson.JSONDecodeError:
                    body = {}
                model, script = self._script(body if isinstance(body, dict) else {})
                self.requests.append((number, model))
                for step in script:
                    if isinstance(step, (int, float)):
                        await asyncio.sleep(step)
                    else:
                        writer.write(step)
                        await writer.drain()
                if model in self.close_after:
                    return
        except (ConnectionError, asyncio.CancelledError):
            return  # the gateway went away, or the test is over (the server closing)
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serve_raw(upstream: RawUpstream) -> AsyncIterator[str]:
    """Run `upstream` on an ephemeral loopback port; yields its base URL."""
    port = await upstream.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        upstream.close()


def http_answer(status: int, headers: Sequence[tuple[str, str]] = (), body: bytes = b"",
                reason: str = "X") -> bytes:
    """An HTTP/1.1 answer's bytes, exactly as given (no header added)."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return f"HTTP/1.1 {status} {reason}\r\n{head}\r\n".encode() + body

def main(argv: list[str] | None = None) -> None:
    """Serve the hostile upstream (and its trap) on --port until killed."""
    from tests.support.servers import serve_app

    parser = argparse.ArgumentParser(description="a hostile upstream (tests/support/hostile.py)")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)

    async def serve() -> None:
        trap = trap_app()
        async with serve_app(trap) as trap_url:
            app = hostile_app(trap_url)
            app[TRAP] = trap
            async with serve_app(app, port=args.port):
                await asyncio.Event().wait()

    asyncio.run(serve())


# -- hostile clients -------------------------------------------------------------------------

async def raw_exchange(host: str, port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data`, read until the server closes."""
    r, w = await asyncio.open_connection(host, port)
    try:
        w.write(data)
        await w.drain()
        return await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()


RESET = b"<connection reset>"


async def _trickle(host: str, port: int, head: bytes, pieces: Iterable[bytes], every_s: float,
                  timeout: float) -> bytes:
    """Send `head`, then `pieces` one write each, `every_s` apart, until the server answers
    or closes; return its answer (RESET if a reset overtook it)."""
    r, w = await asyncio.open_connection(host, port)
    reader = asyncio.ensure_future(r.read())
    try:
        async with asyncio.timeout(timeout):
            if head:
                w.write(head)
            for piece in pieces:
                if reader.done():
                    break
                try:
                    w.write(piece)
                    await w.drain()
                except ConnectionError:
                    break
                if every_s:
                    await asyncio.wait([reader], timeout=every_s)
            try:
                return await reader
            except ConnectionResetError:
                return RESET
    finally:
        reader.cancel()
        w.close()


async def slowloris(host: str, port: int, every_s: float = 0.2, timeout: float = 10.0) -> bytes:
    """Trickle a request's headers one byte at a time; return what the server answered once
    it closed the connection (RESET if a reset overtook its answer: under a flood a reset can
    reach the client before the bytes written ahead of it)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 10_000
    return await _trickle(host, port, b"", (bytes([b]) for b in head), every_s, timeout)


async def idle_connection(host: str, port: int, timeout: float = 10.0) -> bytes:
    """Connect, send nothing; return what the server said before it closed."""
    r, w = await asyncio.open_connection(host, port)
    try:
        return await asyncio.wait_for(r.read(), timeout)
    except ConnectionError:
        return b""
    finally:
        w.close()


def _request_head(key: str, framing: str) -> bytes:
    return ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\n{framing}\r\n\r\n").encode()


async def body_never_arrives(host: str, port: int, key: str, timeout: float = 10.0) -> bytes:
    """An authenticated request that announces 1000 bytes of body and sends 10."""
    return await raw_exchange(host, port, _request_head(key, "Content-Length: 1000")
                              + b'{"model":', timeout)


async def oversized_body(host: str, port: int, key: str, size: int,
                         chunked: bool = False, timeout: float = 10.0) -> bytes:
    """A request whose body is `size` bytes: announced by Content-Length (and 64 KiB of it
    sent), or sent chunked, 64 KiB at a time, until the server answers or closes."""
    if not chunked:
        return await raw_exchange(host, port, _request_head(key, f"Content-Length: {size}")
                                  + b"x" * 65536, timeout)
    chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"
    return await _trickle(host, port, _request_head(key, "Transfer-Encoding: chunked"),
                          (chunk for _ in range(0, size, 65536)), 0.0, timeout)


async def slow_body(host: str, port: int, key: str, every_s: float = 0.2,
                    timeout: float = 10.0) -> bytes:
    """An authenticated request whose 1000-byte body is trickled a byte per `every_s`."""
    return await _trickle(host, port, _request_head(key, "Content-Length: 1000"),
                          (b" " for _ in range(1000)), every_s, timeout)


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else 0


def body_of(raw: bytes) -> bytes:
    return raw.partition(b"\r\n\r\n")[2]




if __name__ == "__main__":
    main()
