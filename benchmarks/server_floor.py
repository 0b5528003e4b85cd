"""What aiohttp's web server costs per request, against a bare protocol on the same C parser:
the most a leaner server protocol for the proxied routes could save.

    python -m benchmarks.server_floor [--reps 3] [--seconds 6] [--connections 16]

Both servers answer the same POST (a 131-byte JSON body, read in full) with the same
chunked SSE answer (the head, one event chunk, the end), on uvloop, pinned to the second
CPU; a closed-loop client on keep-alive connections runs on the first. "aiohttp" is
`web.Application` with one route and a StreamResponse (prepare, write, write_eof); "bare" is
an `asyncio.Protocol` feeding aiohttp's `HttpRequestParser` and writing the answer from a
task per request (as a handler would run). Neither does anything a gateway does: the
difference is the server's own cost. CPU per request is the server process's utime+stime
over the run ÷ requests answered; the medians of the repetitions are printed."""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import uvloop
from aiohttp import web
from aiohttp._http_parser import HttpRequestParser  # type: ignore[import-not-found]

from benchmarks.overhead import free_port

EVENT = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
          b"X-Accel-Buffering: no\r\nTransfer-Encoding: chunked\r\n\r\n"
          + b"%x\r\n%b\r\n" % (len(EVENT), EVENT) + b"0\r\n\r\n")
BODY = (b'{"model":"m","stream":true,"messages":[{"role":"user","content":"' + b"x" * 62
        + b'"}]}')
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
           b"Content-Type: application/json\r\nAuthorization: Bearer k\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY


async def handler(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    await resp.write(EVENT)
    await resp.write_eof()
    return resp


class Bare(asyncio.Protocol):
    """HTTP/1.1 keep-alive on aiohttp's C parser, nothing else (no limits, no errors)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.parser = HttpRequestParser(self, asyncio.get_running_loop(), 2**16,
                                        max_line_size=8190, max_field_size=8190)

    def data_received(self, data: bytes) -> None:
        messages, _, _ = self.parser.feed_data(data)
        for _, payload in messages:
            asyncio.get_running_loop().create_task(self.answer(payload))

    async def answer(self, payload: Any) -> None:
        await payload.read()
        if self.transport is not None:
            self.transport.write(ANSWER)

    # the StreamReader of a request body pauses and resumes its protocol
    def pause_reading(self, *_: Any, **__: Any) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self, *_: Any, **__: Any) -> None:
        if self.transport is not None:
            self.transport.resume_reading()


async def serve(kind: str, port: int) -> None:
    if kind == "aiohttp":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    else:
        await asyncio.get_running_loop().create_server(Bare, "127.0.0.1", port)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def one_connection(port: int, stop: float, answered: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while time.monotonic() < stop:
        writer.write(REQUEST)
        got = b""
        while not got.endswith(b"0\r\n\r\n"):
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            got += data
        answered[0] += 1
    writer.close()


async def load(port: int, connections: int, seconds: float) -> int:
    answered = [0]
    stop = time.monotonic() + seconds
    await asyncio.gather(*(one_connection(port, stop, answered) for _ in range(connections)))
    return answered[0]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kind: str, connections: int, seconds: float) -> float:
    """µs of server CPU per request for one run of `kind`."""
    port = free_port("127.0.0.1")
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.server_floor", "--serve", kind,
                               "--port", str(port)], stdout=subprocess.PIPE)
    try:
        os.sched_setaffinity(server.pid, {max(os.sched_getaffinity(0))})
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        before = cpu_s(server.pid)
        answered = uvloop.run(load(port, connections, seconds))
        return (cpu_s(server.pid) - before) * 1e6 / max(1, answered)
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--serve", choices=("aiohttp", "bare"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        uvloop.run(serve(args.serve, args.port))
        return 0
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    runs: dict[str, list[float]] = {"aiohttp": [], "bare": []}
    for rep in range(1, args.reps + 1):
        for kind, out in runs.items():
            out.append(measure(kind, args.connections, args.seconds))
            print(f"rep {rep} {kind:8} {out[-1]:6.1f} µs/request", flush=True)
    a, b = (statistics.median(runs[k]) for k in ("aiohttp", "bare"))
    print(f"median: aiohttp's web server {a:.1f} µs/request, a bare protocol on its parser "
          f"{b:.1f}: {a - b:.1f} µs/request is aiohttp's server")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
