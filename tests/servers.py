"""Start aiohttp apps on real loopback sockets for tests."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serve_app(app: web.Application, host: str = "127.0.0.1",
                    port: int = 0) -> AsyncIterator[str]:
    """Run `app` on `port` (default: an ephemeral one); yields its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
