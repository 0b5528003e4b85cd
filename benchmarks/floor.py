"""The floor under any Python relay: a bare uvloop byte pump between the load generator and the
simulator, with nothing a gateway does (no HTTP beyond finding where a request ends, no event
parsing, no chunk re-framing: the upstream's chunked frames go out as they came).

    python -m benchmarks.overhead --proxies gateway --tokens 1000 --streams 64 \\
        --gateway-cmd "{python} -m benchmarks.floor {port} {config}"

What it costs per token is what uvloop's read and write (and the two syscalls) cost from
Python; slogate's µs/token above it is the price of being a gateway. Not a product: one
upstream (the config's first backend), keep-alive, no error handling."""
from __future__ import annotations

import asyncio
import sys
import tomllib
from urllib.parse import urlsplit

import uvloop

_END = b"0\r\n\r\n"  # the chunked body's last frame (the simulator streams chunked)


class Upstream(asyncio.Protocol):
    def __init__(self, pool: list[Upstream]) -> None:
        self.pool = pool
        self.client: Client | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None and client.transport is not None:
            client.transport.write(data)
        if data.endswith(_END):  # response over: back to the pool, the client's next request
            self.client = None
            self.pool.append(self)
            if client is not None:
                client.busy = False
                client.next_request()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self in self.pool:
            self.pool.remove(self)


class Client(asyncio.Protocol):
    def __init__(self, pool: list[Upstream], upstream: tuple[str, int]) -> None:
        self.pool = pool
        self.upstream = upstream
        self.buf = b""
        self.busy = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.next_request()

    def next_request(self) -> None:
        if self.busy:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end]
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if len(self.buf) < end + 4 + length:
            return
        request, self.buf = self.buf[:end + 4 + length], self.buf[end + 4 + length:]
        if b" /healthz " in head[:40] and self.transport is not None:  # the harness's probe
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            return
        self.busy = True
        asyncio.ensure_future(self.send(request))

    async def send(self, request: bytes) -> None:
        if self.pool:
            up = self.pool.pop()
        else:
            loop = asyncio.get_running_loop()
            _, up = await loop.create_connection(lambda: Upstream(self.pool), *self.upstream)
        up.client = self
        assert up.transport is not None
        up.transport.write(request)


async def serve(port: int, upstream: tuple[str, int]) -> None:
    pool: list[Upstream] = []
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(pool, upstream), "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    port, config = int(sys.argv[1]), sys.argv[2]
    with open(config, "rb") as f:
        url = urlsplit(tomllib.load(f)["backends"][0]["base_url"])
    assert url.hostname is not None and url.port is not None
    uvloop.run(serve(port, (url.hostname, url.port)))


if __name__ == "__main__":
    main()
