"""A TCP proxy that delays the bytes it relays: a far-away (or slow) service on loopback.

Each direction's bytes leave `rtt_s / 2` after they arrived, in order, so a request and its
answer take `rtt_s` more than without it. `rtt_s` may be changed while it runs (it applies to
the bytes that arrive from then on).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class DelayProxy:
    def __init__(self, target_host: str, target_port: int, rtt_s: float) -> None:
        self.target = (target_host, target_port)
        self.rtt_s = rtt_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for src, dst in ((reader, up_w), (up_r, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        sender = asyncio.create_task(send())
        try:
            while data := await src.read(65536):
                queue.put_nowait((loop.time() + self.rtt_s / 2, data))
            queue.put_nowait((0.0, b""))
            await sender
        except ConnectionError:
            pass
        finally:
            sender.cancel()
            with contextlib.suppress(Exception):
                dst.close()


@contextlib.asynccontextmanager
async def delay_proxy(host: str, port: int, rtt_s: float) -> AsyncIterator[DelayProxy]:
    proxy = DelayProxy(host, port, rtt_s)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


def main() -> None:
    """`python -m tests.support.delay_proxy TARGET_PORT RTT_MS LISTEN_PORT`: run one until
    killed (benchmarks/redis_admission.py runs it as a process of its own)."""
    import sys

    target, rtt_ms, listen = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])

    async def run() -> None:
        proxy = DelayProxy("127.0.0.1", target, rtt_ms / 1e3)
        proxy._server = await asyncio.start_server(proxy._client, "127.0.0.1", listen)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
