"""Scripted upstreams for relay tests: exact bytes, exact chunking, exact timing."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

REQUESTS = web.AppKey("requests", list)
CANCELLED = web.AppKey("cancelled", list)
Step = bytes | float  # bytes: write them (one write, flushed); float: sleep that many seconds


def scripted_app(script: Sequence[Step] | Callable[[dict[str, Any]], Sequence[Step]], *,
                 status: int = 200, headers: dict[str, str] | None = None,
                 abort_at_end: bool = False) -> web.Application:
    """An upstream answering every POST with `script` (or script(body) for each request).

    Records each request's path, headers and JSON body in app[REQUESTS], and each request
    that the gateway abandoned (disconnect) in app[CANCELLED]."""
    app = web.Application()
    requests: list[dict[str, Any]] = []
    app[REQUESTS] = requests
    app[CANCELLED] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        steps = script(body) if callable(script) else script
        resp = web.StreamResponse(status=status, headers=headers or {
            "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for step in steps:
                if isinstance(step, (int, float)):
                    await asyncio.sleep(step)
                else:
                    await resp.write(step)
        except (asyncio.CancelledError, ConnectionResetError):
            app[CANCELLED].append(True)
            raise
        if abort_at_end:
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write_eof()
        return resp

    app.router.add_post("/{tail:.*}", handler)
    return app


def tokens(n: int, gap: float) -> list[Step]:
    """A script of `n` chat chunks ("t0 ", "t1 ", …), each followed by a pause of `gap` s."""
    out: list[Step] = []
    for i in range(n):
        out += [b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
                b'"choices":[{"index":0,"delta":{"content":"t%d "},"finish_reason":null}]}\n\n'
                % i, gap]
    return out


Answer = tuple[int, dict[str, str], Sequence[Step]]  # status, headers, script


def sequenced_app(answers: Sequence[Answer]) -> web.Application:
    """An upstream giving its n-th request the n-th answer (the last one from then on);
    requests recorded in app[REQUESTS] as by scripted_app."""
    app = web.Application()
    requests: list[dict[str, Any]] = []
    app[REQUESTS] = requests
    app[CANCELLED] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        status, headers, steps = answers[min(len(requests), len(answers)) - 1]
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        for step in steps:
            if isinstance(step, (int, float)):
                await asyncio.sleep(step)
            else:
                await resp.write(step)
        await resp.write_eof()
        return resp

    app.router.add_post("/{tail:.*}", handler)
    return app
