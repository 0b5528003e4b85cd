"""Scripted upstreams for relay tests: exact bytes, exact chunking, exact timing."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

REQUESTS = web.AppKey("requests", list)
CANCELLED = web.AppKey("cancelled", list)
Step = bytes | float  # bytes: write them (one write, flushed); float: sleep that many seconds
Answer = tuple[int, dict[str, str], Sequence[Step]]  # status, headers, script


def scripted_app(script: Sequence[Step] | Callable[[dict[str, Any]], Sequence[Step]], *,
                 status: int = 200, headers: dict[str, str] | None = None,
                 abort_at_end: bool = False) -> web.Application:
    """An upstream answering every POST with `script` (or script(body) for each request).

    Records each request's path, headers and JSON body in app[REQUESTS], and each request
    that the gateway abandoned (disconnect) in app[CANCELLED] (when: time.monotonic())."""
    def answer(body: dict[str, Any]) -> Answer:
        return (status, headers or {"Content-Type": "text/event-stream"},
                script(body) if callable(script) else script)

    return _upstream(answer, abort_at_end)


def _upstream(answer: Callable[[dict[str, Any]], Answer], abort_at_end: bool) -> web.Application:
    app = web.Application()
    requests: list[dict[str, Any]] = []
    app[REQUESTS] = requests
    app[CANCELLED] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        status, headers, steps = answer(body)
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        try:
            for step in steps:
                if isinstance(step, (int, float)):
                    await asyncio.sleep(step)
                else:
                    await resp.write(step)
        except (asyncio.CancelledError, ConnectionResetError):
            app[CANCELLED].append(time.monotonic())
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


def sequenced_app(answers: Sequence[Answer]) -> web.Application:
    """An upstream giving its n-th request the n-th answer (the last one from then on);
    requests recorded in app[REQUESTS] as by scripted_app."""
    count = 0

    def answer(body: dict[str, Any]) -> Answer:
        nonlocal count
        count += 1
        return answers[min(count, len(answers)) - 1]

    return _upstream(answer, abort_at_end=False)
