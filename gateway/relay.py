"""Relay: upstream bytes to the client as they arrive, observed on the way.

Bytes are forwarded unchanged and in order, one write per upstream read. Two things are held:
- before commit (policy `first_token`), everything up to the first token, so that a failure
  before it can still be retried elsewhere or answered as a clean HTTP error;
- the bytes of an event that is not complete yet (at most HOLD_LIMIT of them). A client can do
  nothing with half an event (SSE dispatches on the blank line), so this costs it no latency,
  and it lets the gateway drop the usage chunk it injected and end a cut stream with an error
  event that the client can parse.

Deadlines are the Watchdog's business: when it fires, the read is cancelled; before commit that
is an AttemptFailed (retryable), after commit the stream ends with an error event in the
client's API format.
"""
from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from gateway import deadlines
from gateway.context import (GATEWAY_ERROR, OK, TIMEOUT, UPSTREAM_ERROR, UPSTREAM_TRUNCATED,
                             RequestContext, now_ns)
from gateway.deadlines import Watchdog
from gateway.limits import EVENT_TOO_LARGE, EventTooLarge
from gateway.sse import DEFAULT_MAX_EVENT_BYTES, SSEParser

HOLD_LIMIT = 64 * 1024
PING = b": ping\n\n"


class ClientGone(Exception):
    """The client went away while we wrote to it."""


class AttemptFailed(Exception):
    """An upstream attempt failed before anything was committed to the client: routing may
    try another replica. `result` is its label in upstream_attempts_total."""

    def __init__(self, result: str, status: int, message: str, code: str, *,
                 retryable: bool = True, retry_after_s: float | None = None,
                 response: tuple[int, dict[str, str], bytes] | None = None) -> None:
        super().__init__(message)
        self.result = result
        self.status = status
        self.message = message
        self.code = code
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.response = response  # an upstream error response to pass through if it is final


async def write(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
        raise ClientGone() from e


def before_commit_failure(reason: str) -> AttemptFailed:
    if reason == deadlines.FIRST_TOKEN:
        return AttemptFailed(reason, 504, "The upstream sent no token before the first-token "
                             "deadline.", reason)
    if reason == deadlines.TOTAL:
        return AttemptFailed(reason, 504, "The request ran past its total deadline.", reason,
                             retryable=False)
    return AttemptFailed(reason, 503, "The gateway is shutting down.", reason, retryable=False)


class Relay:
    """One streamed response: upstream `up` → client, through `observer`."""

    def __init__(self, request: web.Request, ctx: RequestContext, up: aiohttp.ClientResponse,
                 observer, api, headers, *, hold_until_first_token: bool, watchdog: Watchdog,
                 keepalive_s: float = 0.0,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.request = request
        self.ctx = ctx
        self.up = up
        self.observer = observer
        self.api = api
        self.headers = headers
        self.hold = hold_until_first_token
        self.watchdog = watchdog
        self.keepalive_s = keepalive_s
        self.max_event_bytes = max_event_bytes  # one event, and all that is held before commit
        self.held_bytes = 0
        self.client: web.StreamResponse | None = None
        self.held: list[bytes] = []  # before commit
        self.t_last_write = 0
        self.partial_out = False  # part of an unfinished event went out (over HOLD_LIMIT)
        self._commit_lock = asyncio.Lock()

    async def _commit(self) -> None:
        async with self._commit_lock:
            if self.client is not None:
                return
            resp = web.StreamResponse(status=self.up.status, headers=self.headers)
            await resp.prepare(self.request)
            self.ctx.t_committed = now_ns()
            self.client = resp
            first, self.held = b"".join(self.held), []
            if first:
                await write(resp, first)
            self.t_last_write = now_ns()

    async def _keepalive(self) -> None:
        """Comment pings while the client would otherwise see nothing (load balancers drop
        idle connections, LiteLLM #34819). Before commit, the first ping commits."""
        interval = self.keepalive_s
        self.t_last_write = now_ns()
        while True:
            await asyncio.sleep(max(0.0, interval - (now_ns() - self.t_last_write) / 1e9))
            if (now_ns() - self.t_last_write) / 1e9 < interval or self.partial_out:
                continue
            if self.client is None:
                await self._commit()
            await write(self.client, PING)  # type: ignore[arg-type]
            self.t_last_write = now_ns()

    async def run(self) -> web.StreamResponse:
        pinger = (asyncio.create_task(self._keepalive()) if self.keepalive_s > 0 else None)
        try:
            return await self._run()
        finally:
            if pinger is not None:
                pinger.cancel()

    async def _run(self) -> web.StreamResponse:
        ctx = self.ctx
        parser = SSEParser(self.max_event_bytes)
        feed = parser.feed
        on_event = self.observer.on_event
        pending = b""  # start of an incomplete event
        drop_lf = False  # a dropped event ended in CR: the LF opening the next read is its
        idle_armed = False
        try:
            async for chunk in self.up.content.iter_any():
                t = now_ns()
                lf_owed, drop_lf = drop_lf, False
                events = feed(chunk)
                base = len(pending)
                buf = pending + chunk if base else chunk
                drops = None
                if events:
                    ctx.t_last_event = t
                    for ev in events:
                        if not on_event(ev, t):
                            start = ev.start + base if ev.start >= 0 else 0
                            end = ev.end + base
                            (drops := drops or []).append((start, end))
                            if end == len(buf) and parser.skip_lf:
                                drop_lf = True
                    if not idle_armed and ctx.t_first_token:
                        self.watchdog.first_token()
                        idle_armed = True
                        if ctx.on_first_token is not None:
                            ctx.on_first_token()
                hold_from = parser.hold_from
                if hold_from is None:
                    cut = len(buf)
                else:
                    cut = hold_from + base if hold_from >= 0 else 0
                    if len(buf) - cut > HOLD_LIMIT:
                        cut = len(buf)
                        self.partial_out = True
                if drops:
                    out_parts, prev = [], 0
                    for s, e in drops:
                        out_parts.append(buf[prev:s])
                        prev = e
                    out_parts.append(buf[prev:cut])
                    out = b"".join(out_parts)
                else:
                    out = buf if cut == len(buf) else buf[:cut]
                if cut < len(buf):
                    pending = buf[cut:]
                else:
                    pending = b""
                    self.partial_out = False
                if lf_owed and out[:1] == b"\n":
                    out = out[1:]
                client = self.client
                if client is not None:
                    if out:
                        try:
                            await client.write(out)
                        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
                            raise ClientGone() from e
                        self.t_last_write = t
                else:
                    if out:
                        self.held.append(out)
                        self.held_bytes += len(out)
                    if not self.hold or ctx.t_first_token or ctx.done or ctx.error_type:
                        await self._commit()
                    elif self.held_bytes + len(pending) > self.max_event_bytes:
                        raise EventTooLarge(self.held_bytes + len(pending), self.max_event_bytes,
                                            "answer without a first token")
                ctx.overhead_ns += now_ns() - t
        except asyncio.CancelledError:
            reason = self.watchdog.claim()
            if reason is None:
                raise  # the client went away
            if self.client is None:
                raise before_commit_failure(reason) from None
            return await self._end_with_error(reason, TIMEOUT if reason != deadlines.SHUTDOWN
                                              else GATEWAY_ERROR, f"The stream was ended: {reason}.")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ctx.error_type = "upstream_connection_lost"
        except EventTooLarge as e:
            return await self._too_large(e)
        if ctx.done:
            if self.client is None:
                await self._commit()
            if pending:
                await write(self.client, pending)  # type: ignore[arg-type]
            # An in-band error followed by [DONE] (vLLM) is still a failed request.
            if ctx.error_type:
                ctx.interruption = "upstream_error"
            ctx.finish(UPSTREAM_ERROR if ctx.error_type else OK)
            return await self._eof()
        if self.client is None:
            raise AttemptFailed("closed_before_first_token", 502, "The upstream closed the "
                                "stream before the first token.", "upstream_stream_truncated")
        return await self._end_with_error(ctx.error_type or "stream_truncated",
                                          UPSTREAM_TRUNCATED, "The upstream closed the stream "
                                          "before it was complete.", code="stream_truncated")

    async def _too_large(self, e: EventTooLarge) -> web.StreamResponse:
        """Before commit a failed attempt (retried once: a second upstream may behave, a third
        read of the same flood would not help); after commit an error event."""
        self.held = []
        if self.client is None:
            again = not any(a.result == EVENT_TOO_LARGE for a in self.ctx.attempts)
            raise AttemptFailed(EVENT_TOO_LARGE, 502, str(e), EVENT_TOO_LARGE, retryable=again)
        return await self._end_with_error(EVENT_TOO_LARGE, UPSTREAM_ERROR, str(e))

    async def _end_with_error(self, reason: str, outcome: str, message: str,
                              code: str | None = None) -> web.StreamResponse:
        """A committed stream that cannot complete ends with an error event in the client's
        API format: never a silent clean close (Portkey #1797)."""
        ctx = self.ctx
        ctx.interruption = reason
        ctx.finish(outcome, reason)
        await write(self.client, self.api.stream_error_event(message, code or reason, ctx))  # type: ignore[arg-type]
        return await self._eof()

    async def _eof(self) -> web.StreamResponse:
        assert self.client is not None
        try:
            await self.client.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
            raise ClientGone() from e
        return self.client
