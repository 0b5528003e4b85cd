"""Start aiohttp apps on real loopback sockets for tests."""
from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator
from typing import Any

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


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """Terminate a child process, killing it if it does not exit in time."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
