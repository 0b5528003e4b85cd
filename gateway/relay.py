"""Relay: upstream bytes to the client as they arrive, observed on the way.

Bytes are forwarded unchanged and in order, one write per upstream read. Two things are held:
- before commit (policy `first_token`), everything up to the first token, so that a failure
  before it can still be answered as a clean HTTP error;
- the bytes of an event that is not complete yet (at most HOLD_LIMIT of them). A client can do
  nothing with half an event (SSE dispatches on the blank line), so this costs it no latency,
  and it lets the gateway drop the usage chunk it injected and end a cut stream with an error
  event that the client can parse.
"""
from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from gateway.context import OK, UPSTREAM_ERROR, UPSTREAM_TRUNCATED, RequestContext, now_ns
from gateway.errors import GatewayError
from gateway.sse import SSEParser

HOLD_LIMIT = 64 * 1024


class ClientGone(Exception):
    """The client went away while we wrote to it."""


async def write(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
        raise ClientGone() from e


class Relay:
    """One streamed response: upstream `up` → client, through `observer`."""

    def __init__(self, request: web.Request, ctx: RequestContext, up: aiohttp.ClientResponse,
                 observer, api, headers, hold_until_first_token: bool) -> None:
        self.request = request
        self.ctx = ctx
        self.up = up
        self.observer = observer
        self.api = api
        self.headers = headers
        self.hold = hold_until_first_token
        self.client: web.StreamResponse | None = None

    async def _commit(self, first: bytes) -> None:
        resp = web.StreamResponse(status=self.up.status, headers=self.headers)
        await resp.prepare(self.request)
        self.ctx.t_committed = now_ns()
        self.client = resp
        if first:
            await write(resp, first)

    async def run(self) -> web.StreamResponse:
        ctx = self.ctx
        parser = SSEParser()
        feed = parser.feed
        on_event = self.observer.on_event
        held: list[bytes] = []  # before commit
        pending = b""  # start of an incomplete event
        drop_lf = False  # a dropped event ended in CR: the LF opening the next read is its
        try:
            async for chunk in self.up.content.iter_any():
                t = now_ns()
                lf_owed, drop_lf = drop_lf, False
                events = feed(chunk)
                base = len(pending)
                buf = pending + chunk if base else chunk
                drops = None
                for ev in events:
                    if not on_event(ev, t):
                        start = ev.start + base if ev.start >= 0 else 0
                        end = ev.end + base
                        (drops := drops or []).append((start, end))
                        if end == len(buf) and parser.skip_lf:
                            drop_lf = True
                hold_from = parser.hold_from
                if hold_from is None:
                    cut = len(buf)
                else:
                    cut = hold_from + base if hold_from >= 0 else 0
                    if len(buf) - cut > HOLD_LIMIT:
                        cut = len(buf)
                if drops:
                    out_parts, prev = [], 0
                    for s, e in drops:
                        out_parts.append(buf[prev:s])
                        prev = e
                    out_parts.append(buf[prev:cut])
                    out = b"".join(out_parts)
                else:
                    out = buf if cut == len(buf) else buf[:cut]
                pending = buf[cut:] if cut < len(buf) else b""
                if lf_owed and out[:1] == b"\n":
                    out = out[1:]
                client = self.client
                if client is not None:
                    if out:
                        try:
                            await client.write(out)
                        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
                            raise ClientGone() from e
                elif (not self.hold or ctx.t_first_token or ctx.done or ctx.error_type):
                    held.append(out)
                    await self._commit(b"".join(held))
                    held = []
                elif out:
                    held.append(out)
                ctx.overhead_ns += now_ns() - t
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ctx.error_type = "upstream_connection_lost"
        if ctx.done:
            if self.client is None:
                await self._commit(b"".join(held))
            if pending:
                await write(self.client, pending)
            # An in-band error followed by [DONE] (vLLM) is still a failed request.
            if ctx.error_type:
                ctx.interruption = "upstream_error"
            ctx.finish(UPSTREAM_ERROR if ctx.error_type else OK)
        else:
            ctx.finish(UPSTREAM_TRUNCATED, ctx.error_type or "stream_truncated")
            message = "The upstream closed the stream before it was complete."
            if self.client is None:
                raise GatewayError(502, message, "upstream_stream_truncated",
                                   outcome=UPSTREAM_TRUNCATED)
            ctx.interruption = ctx.error_type or "stream_truncated"
            await write(self.client, self.api.stream_error_event(message, "stream_truncated"))
        try:
            await self.client.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
            raise ClientGone() from e
        return self.client
