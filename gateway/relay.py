"""Relay: upstream bytes to the client as they arrive, observed on the way.

Bytes are forwarded unchanged and in order, one write per upstream read. Two things are held:
- before commit (policy `first_token`), everything up to the first token, so that a failure
  before it can still be retried elsewhere or answered as a clean HTTP error;
- the bytes of an event that is not complete yet (at most HOLD_LIMIT of them). A client can do
  nothing with half an event (SSE dispatches on the blank line), so this costs it no latency,
  and it lets the gateway drop the usage chunk it injected and end a cut stream with an error
  event that the client can parse.

`Splicer` is the pure core (upstream reads in, client bytes out, the exchange's timeline
stamped); `Relay` is the I/O around it. Deadlines are the Watchdog's business: when it fires,
the read is cancelled; before commit that is an AttemptFailed (retryable), after commit the
stream ends with an error event in the client's API format.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from gateway.errors import (
    CLOSED_BEFORE_FIRST_TOKEN,
    GATEWAY_ERROR,
    OK,
    SHUTDOWN,
    TIMEOUT,
    UPSTREAM_ERROR,
    UPSTREAM_TRUNCATED,
    AttemptFailed,
    ClientGone,
    deadline_failure,
)
from gateway.exchange import Exchange, now_ns
from gateway.limits import EVENT_TOO_LARGE, EventTooLarge
from gateway.sse import DEFAULT_MAX_EVENT_BYTES, SSEParser

if TYPE_CHECKING:
    from gateway.apis.base import Api
    from gateway.deadlines import Watchdog

HOLD_LIMIT = 64 * 1024
PING = b": ping\n\n"
CAPTURE_LIMIT = 16 * 1024  # characters of output text kept when content capture is on


def splice(buf: bytes, drops: list[tuple[int, int]] | None, cut: int) -> bytes:
    """`buf[:cut]` without the byte ranges in `drops` (sorted, disjoint, each [start, end))."""
    if not drops:
        return buf if cut == len(buf) else buf[:cut]
    parts, prev = [], 0
    for start, end in drops:
        parts.append(buf[prev:start])
        prev = end
    parts.append(buf[prev:cut])
    return b"".join(parts)


class Splicer:
    """Turns upstream reads into the bytes the client gets: parses events, has the API adapter
    say what each is, stamps the exchange, drops the usage chunk the gateway asked for, and
    keeps the start of an incomplete event back (up to HOLD_LIMIT). No I/O."""

    __slots__ = ("ex", "api", "route", "parser", "pending", "drop_lf", "partial_out", "capture")

    def __init__(self, ex: Exchange, api: Api, capture: list[str] | None = None,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.ex = ex
        self.api = api
        self.route = ex.route
        self.parser = SSEParser(max_event_bytes)  # raises EventTooLarge past the bound
        self.pending = b""  # start of an incomplete event
        self.drop_lf = False  # a dropped event ended in CR: the LF opening the next read is its
        self.partial_out = False  # part of an unfinished event went out (over HOLD_LIMIT)
        self.capture = capture  # output text, when the operator opted in to content capture

    def feed(self, chunk: bytes, t: int) -> bytes:
        ex = self.ex
        parser = self.parser
        lf_owed, self.drop_lf = self.drop_lf, False
        events = parser.feed(chunk)
        pending = self.pending
        base = len(pending)
        buf = pending + chunk if base else chunk
        drops: list[tuple[int, int]] | None = None
        if events:
            ex.t_last_event = t
            observe, route, drop_usage = self.api.observe, self.route, ex.usage_injected
            for ev in events:
                info = observe(ev, route)
                ex.event_seen(info, t)
                if info.usage_only and drop_usage:
                    start = ev.start + base if ev.start >= 0 else 0
                    end = ev.end + base
                    (drops := drops or []).append((start, end))
                    if end == len(buf) and parser.skip_lf:
                        self.drop_lf = True
                elif self.capture is not None and info.token:
                    self._capture(ev)
        hold_from = parser.hold_from
        if hold_from is None:  # the read ended on an event boundary
            cut = len(buf)
            self.partial_out = False
        else:
            cut = hold_from + base if hold_from >= 0 else 0
            if len(buf) - cut > HOLD_LIMIT:
                cut = len(buf)
                self.partial_out = True  # no ping may go out until this event ends
        out = splice(buf, drops, cut)
        self.pending = buf[cut:] if cut < len(buf) else b""
        if lf_owed and out[:1] == b"\n":
            out = out[1:]
        return out

    def _capture(self, ev: object) -> None:
        capture = self.capture
        assert capture is not None
        if sum(map(len, capture)) < CAPTURE_LIMIT:
            text = self.api.output_text(ev)  # type: ignore[arg-type]
            if text:
                capture.append(text)


class Relay:
    """One streamed response: the upstream response of `ex.attempt` → the client."""

    def __init__(self, request: web.Request, ex: Exchange, up: aiohttp.ClientResponse,
                 api: Api, headers: object, *, hold_until_first_token: bool,
                 watchdog: Watchdog, keepalive_s: float = 0.0,
                 capture: list[str] | None = None,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.request = request
        self.ex = ex
        self.up = up
        self.api = api
        self.headers = headers
        self.hold = hold_until_first_token
        self.watchdog = watchdog
        self.keepalive_s = keepalive_s
        self.splicer = Splicer(ex, api, capture, max_event_bytes)
        self.max_event_bytes = max_event_bytes  # one event, and all that is held before commit
        self.held_bytes = 0
        self.held: list[bytes] = []  # before commit
        self.t_last_write = 0
        self._commit_lock = asyncio.Lock()

    async def _commit(self) -> None:
        """Send the response headers and what was held, once. The exchange's `response` is
        the commit state; it is published after the held bytes are taken, with no await in
        between, so bytes arriving meanwhile keep their order. The lock only serialises the
        reader and the keepalive pinger."""
        async with self._commit_lock:
            ex = self.ex
            if ex.response is not None:
                return
            resp = web.StreamResponse(status=self.up.status, headers=self.headers)  # type: ignore[arg-type]
            try:
                await resp.prepare(self.request)
            except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
                raise ClientGone() from e
            ex.t_committed = now_ns()
            first, self.held = b"".join(self.held), []
            ex.response = resp
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
            if (now_ns() - self.t_last_write) / 1e9 < interval or self.splicer.partial_out:
                continue
            try:
                await self._commit()
                if self.ex.response is not None:
                    await write(self.ex.response, PING)
            except ClientGone:
                return  # the reader finds out at its next write; nothing to ping any more
            self.t_last_write = now_ns()

    async def run(self) -> web.StreamResponse:
        pinger = (asyncio.create_task(self._keepalive()) if self.keepalive_s > 0 else None)
        try:
            return await self._run()
        finally:
            if pinger is not None:
                pinger.cancel()

    async def _run(self) -> web.StreamResponse:
        ex = self.ex
        feed = self.splicer.feed
        idle_armed = False
        try:
            async for chunk in self.up.content.iter_any():
                t = now_ns()
                out = feed(chunk, t)
                if not idle_armed and ex.t_first_token:
                    self.watchdog.first_token()
                    idle_armed = True
                    if ex.on_first_token is not None:
                        ex.on_first_token()
                client = ex.response
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
                    if not self.hold or ex.t_first_token or ex.done or ex.error_type:
                        await self._commit()
                    elif self.held_bytes + len(self.splicer.pending) > self.max_event_bytes:
                        raise EventTooLarge(self.held_bytes + len(self.splicer.pending),
                                            self.max_event_bytes, "answer without a first token")
                ex.overhead_ns += now_ns() - t
        except asyncio.CancelledError:
            reason = self.watchdog.claim()
            if reason is None:
                raise  # the client went away
            if not ex.t_committed:
                raise deadline_failure(reason) from None
            outcome = GATEWAY_ERROR if reason == SHUTDOWN else TIMEOUT
            return await self._end_with_error(reason, outcome,
                                              f"The stream was ended: {reason}.")
        except (TimeoutError, aiohttp.ClientError):
            ex.error_type = "upstream_connection_lost"
        except EventTooLarge as e:
            return await self._too_large(e)
        if ex.done:
            await self._commit()
            pending = self.splicer.pending
            if pending:
                await write(self._client(), pending)
            # An in-band error followed by [DONE] (vLLM) is still a failed request.
            if ex.error_type:
                ex.interruption = "upstream_error"
            ex.finish(UPSTREAM_ERROR if ex.error_type else OK)
            return await self._eof()
        if not ex.t_committed:
            raise AttemptFailed(CLOSED_BEFORE_FIRST_TOKEN, 502, "The upstream closed the "
                                "stream before the first token.", "upstream_stream_truncated")
        return await self._end_with_error(ex.error_type or "stream_truncated",
                                          UPSTREAM_TRUNCATED, "The upstream closed the stream "
                                          "before it was complete.", code="stream_truncated")

    def _client(self) -> web.StreamResponse:
        assert self.ex.response is not None, "committed"
        return self.ex.response

    async def _too_large(self, e: EventTooLarge) -> web.StreamResponse:
        """Before commit a failed attempt (retried once: a second upstream may behave, a third
        read of the same flood would not help); after commit an error event."""
        self.held = []
        if not self.ex.t_committed:
            again = not any(a.result == EVENT_TOO_LARGE for a in self.ex.attempts)
            raise AttemptFailed(EVENT_TOO_LARGE, 502, str(e), EVENT_TOO_LARGE, retryable=again)
        return await self._end_with_error(EVENT_TOO_LARGE, UPSTREAM_ERROR, str(e))

    async def _end_with_error(self, reason: str, outcome: str, message: str,
                              code: str | None = None) -> web.StreamResponse:
        """A committed stream that cannot complete ends with an error event in the client's
        API format: never a silent clean close (Portkey #1797)."""
        ex = self.ex
        ex.interruption = reason
        ex.finish(outcome, reason)
        await write(self._client(), self.api.stream_error_event(message, code or reason,
                                                                ex.events))
        return await self._eof()

    async def _eof(self) -> web.StreamResponse:
        client = self._client()
        try:
            await client.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
            raise ClientGone() from e
        return client


async def write(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
        raise ClientGone() from e
