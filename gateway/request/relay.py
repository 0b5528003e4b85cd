"""Relay: upstream bytes to the client as they arrive, observed on the way.

Bytes are forwarded unchanged and in order, one write per upstream read. Two things are held:
- before commit (policy `first_token`), everything up to the first token, so that a failure
  before it can still be retried elsewhere or answered as a clean HTTP error;
- the bytes of an event that is not complete yet, however long (the parser bounds an event at
  max_event_bytes). A client can do nothing with half an event (SSE dispatches on the blank
  line), so this costs it no latency, and it lets the gateway drop the usage chunk it injected
  and end a cut stream, or one with an event over the limit, with an error event that the
  client can parse: half an event sent first would be parsed with the error and break it.

`Splicer` is the pure core (upstream reads in, client bytes out, the exchange's timeline
stamped); `Relay` is the I/O around it. Deadlines are the Watchdog's business: when it fires,
the read is cancelled; before commit that is an AttemptFailed (retryable), after commit the
stream ends with an error event in the client's API format.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from gateway.apis import failures
from gateway.apis.sse import DEFAULT_MAX_EVENT_BYTES, SSEEvent, SSEParser
from gateway.edge.limits import EVENT_TOO_LARGE
from gateway.errors import (
    ATTEMPT_CONTEXT_LENGTH,
    ATTEMPT_CUT,
    ATTEMPT_HEDGE_LOST,
    ATTEMPT_IN_BAND_ERROR,
    ATTEMPT_STALLED,
    CLOSED_BEFORE_FIRST_TOKEN,
    GATEWAY_ERROR,
    IDLE,
    OK,
    PREEMPTED,
    SHUTDOWN,
    TIMEOUT,
    UPSTREAM_ERROR,
    UPSTREAM_TRUNCATED,
    AttemptFailed,
    ClientGone,
    EventTooLarge,
    StreamBroken,
    UpstreamLost,
    deadline_failure,
)
from gateway.exchange import Exchange
from gateway.telemetry.tracing import CAPTURE_LIMIT
from gateway.timeline import now_ns
from gateway.transport.wire import (
    ClientWire,
    CoalescedResponse,
    PreparedHead,
    UpstreamBody,
    prepare_head,
    start_response,
    write,
    write_eof,
)

if TYPE_CHECKING:
    from gateway.apis.base import Api, EventInfo, Splice, TokenShape
    from gateway.request.deadlines import Watchdog
    from gateway.transport.client import UpstreamResponse

# An unfinished event is kept as one bytes object (joined with each read) up to this size, and
# as a list of reads beyond it: no copy of what is held per read.
JOIN_LIMIT = 64 * 1024
# A backend's error event after the first token, and what follows it, held back while another
# backend may finish the answer: an error is small; more than this is a flood, not kept.
ERROR_HOLD_LIMIT = 64 * 1024
_EOF = object()  # the body's end, as the sink reports it to the coroutine
_LINGERED = object()  # the upstream did not end its body within TERMINAL_GRACE_S of its end
# After the protocol's terminal event the upstream should end its body at once (and its
# connection goes back to the pool); one that lingers is not waited for longer than this.
TERMINAL_GRACE_S = 0.25


def complete_at_eof(ex: Exchange, choices: int) -> bool:
    """A stream that ends without its terminal event (`[DONE]`, `message_stop`) is still a
    complete answer once every choice has its finish reason and the usage the gateway asked for
    has come: some servers close without the terminator."""
    return (len(ex.finish_reasons) >= choices and not ex.error_type
            and (not ex.usage_injected or ex.completion_tokens is not None))
PING = b": ping\n\n"


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


@dataclass(slots=True)
class Replay:
    """A first-token race's winning hedge as its probe leaves it for the request's relay: its
    body (paused, still hooked to the probe), its reads with their arrival times, and how the
    body ended meanwhile, if it did (True: its end; else what failed it)."""
    body: UpstreamBody
    reads: list[tuple[bytes, int]] = field(default_factory=list)
    ended: BaseException | bool | None = None


class RaceClaim(Protocol):
    """A first-token race (request/hedge.py's Race), as the relay of its first attempt sees
    it: the commit claims it."""

    def primary_claims(self) -> bool: ...


class Splicer:
    """Turns upstream reads into the bytes the client gets: parses events, has the API adapter
    say what each is, stamps the exchange, drops the usage chunk the gateway asked for, and
    keeps an incomplete event back until it completes. No I/O."""

    __slots__ = ("ex", "api", "route", "parser", "pending", "parts", "parts_size", "drop_lf",
                 "capture", "captured", "shape", "shape_tries", "shape_from", "kept", "splice",
                 "held_error", "held_flooded")

    def __init__(self, ex: Exchange, api: Api, capture: list[str] | None = None,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
                 splice: Splice | None = None) -> None:
        self.ex = ex
        self.api = api
        self.route = ex.route
        self.parser = SSEParser(max_event_bytes)  # raises EventTooLarge past the bound
        # An incomplete event held back: its bytes, or (past JOIN_LIMIT) its reads in `parts`,
        # when `pending` is empty.
        self.pending = b""
        self.parts: list[bytes] = []
        self.parts_size = 0
        self.drop_lf = False  # a dropped event ended in CR: the LF opening the next read is its
        self.capture = capture  # output text, when the operator opted in to content capture
        self.captured = 0  # characters in it (kept up to CAPTURE_LIMIT)
        # The stream's ordinary token event as bytes around its text (the API adapter's
        # TokenShape): later tokens that fit it are stamped without being parsed.
        self.shape: TokenShape | None = None
        self.shape_tries = 4
        # The event a shape is to be taken from, not taken yet: the read that brings the first
        # token commits before it (`learn_shape`), and the read that needs the shape takes it.
        self.shape_from: tuple[SSEEvent, EventInfo] | None = None
        # A stream that may be continued keeps the text the client got (so no token shape:
        # every event is read); one that continues another has its events rewritten.
        self.kept = ex.streamed_text
        self.splice = splice
        # Such a stream's backend error after its first token, and what followed, held back
        # from the client (None: none): another backend may finish the answer instead.
        self.held_error: bytearray | None = None
        self.held_flooded = False

    def feed(self, chunk: bytes, t: int) -> bytes:
        if self.splice is not None:
            return self._feed_spliced(chunk, t)
        if self.held_error is not None:  # still parsed: its end is the attempt's
            self._hold(chunk)
            for ev in self.parser.feed(chunk):
                self.ex.t_last_event = t
                self._observe(ev, t)
            return b""
        ex = self.ex
        parser = self.parser
        # (`parts` held means the parser is inside an event: neither fast path is taken)
        if not self.pending and not self.drop_lf:
            shape = self.shape if self.shape_from is None else self.learn_shape()
            if shape is not None and shape.fits_event(chunk) and parser.between_events():
                ex.t_last_event = t  # another ordinary token, one whole event in this read
                ex.event_seen(shape.info, t)
                return chunk
            data = parser.whole_event(chunk)
            if data is not None:  # one whole event that no shape fits (it would fit the read)
                ex.t_last_event = t
                info = self._observe(SSEEvent(None, data, 0, len(chunk)), t)
                if info.error_type is not None and self.holding():
                    self._hold(chunk)
                    return b""
                return b"" if info.usage_only and ex.usage_injected else chunk
        lf_owed, self.drop_lf = self.drop_lf, False
        events = parser.feed(chunk)
        pending = self.pending
        base = len(pending)
        buf = pending + chunk if base else chunk
        drops: list[tuple[int, int]] | None = None
        hold_at: int | None = None  # where a held backend error begins in `buf`
        hold_began_before = False  # …or it began in an earlier read (in `parts`)
        drop_parts = False
        if events:
            ex.t_last_event = t
            drop_usage = ex.usage_injected
            for ev in events:
                shape = self.shape if self.shape_from is None else self.learn_shape()
                if shape is not None and ev.event is None and shape.fits(ev.data):
                    ex.event_seen(shape.info, t)
                    continue
                info = self._observe(ev, t)
                if hold_at is not None:
                    continue  # after a held error: held with it
                if info.error_type is not None and self.holding():
                    # this error and the rest of the read are held
                    hold_at = ev.start + base if ev.start >= 0 else 0
                    hold_began_before = ev.start < 0
                    continue
                if info.usage_only and drop_usage:
                    drop_parts = drop_parts or ev.start < 0  # it began in what was held
                    start = ev.start + base if ev.start >= 0 else 0
                    end = ev.end + base
                    (drops := drops or []).append((start, end))
                    if end == len(buf) and parser.skip_lf:
                        self.drop_lf = True
        if hold_at is not None:
            out = splice(buf, drops, hold_at)
            earlier = b"".join(self.parts)
            self.parts, self.parts_size, self.pending = [], 0, b""
            if hold_began_before:  # what was held is the error event's start
                self._hold(earlier + buf[hold_at:])
            else:
                if not drop_parts:
                    out = earlier + out
                self._hold(buf[hold_at:])
            return out[1:] if lf_owed and out[:1] == b"\n" else out
        hold_from = parser.hold_from
        if hold_from == -1:  # the read only goes on with what is held (no event ended in it)
            out, rest = b"", buf
        else:  # what was held ended in this read (None: so did the read)
            cut = len(buf) if hold_from is None else hold_from + base
            out = splice(buf, drops, cut)
            if self.parts:
                if not drop_parts:
                    out = b"".join(self.parts) + out
                self.parts, self.parts_size = [], 0
            rest = buf[cut:] if cut < len(buf) else b""
        if self.parts or len(rest) > JOIN_LIMIT:
            self.parts.append(rest)
            self.parts_size += len(rest)
            self.pending = b""
        else:
            self.pending = rest
        if lf_owed and out[:1] == b"\n":
            out = out[1:]
        return out

    def holding(self) -> bool:
        """Is a backend error being held back (mypy: `_observe` may start it mid-read)?"""
        return self.held_error is not None

    def _hold(self, data: bytes) -> None:
        """Bounded: past ERROR_HOLD_LIMIT (an upstream that floods after its error) nothing is
        kept, and the stream ends with the gateway's own error event if it is not continued."""
        held = self.held_error
        assert held is not None
        if self.held_flooded:
            return
        if len(held) + len(data) > ERROR_HOLD_LIMIT:
            self.held_flooded = True
            held.clear()
        else:
            held += data

    @property
    def held_size(self) -> int:
        """Bytes of an incomplete event held back."""
        return self.parts_size + len(self.pending)

    def held_back(self) -> bytes:
        """The bytes of an incomplete event held back, in order."""
        return b"".join(self.parts) + self.pending if self.parts else self.pending

    def _feed_spliced(self, chunk: bytes, t: int) -> bytes:
        """A continuation's reads: only whole events go out, each rewritten as the client's
        answer going on (the API adapter's splice_event)."""
        assert self.splice is not None
        events = self.parser.feed(chunk)
        if not events:
            return b""
        ex = self.ex
        ex.t_last_event = t
        out = []
        for ev in events:
            info = self._observe(ev, t)
            if info.completion_tokens is not None:  # counted as the client's answer
                _count_as_received(ex, self.splice.tokens_before)
            if info.usage_only and ex.usage_injected:
                continue
            spliced = self.api.splice_event(ev, self.splice)
            if spliced:
                out.append(spliced)
        return b"".join(out)

    def _observe(self, ev: SSEEvent, t: int) -> EventInfo:
        """Parse one event (the API adapter says what it is) and stamp it; capture its text
        when asked to. An ordinary token that the shape did not fit (its text has escapes,
        or there is no shape yet) may give the stream a new shape: a few times per stream,
        then no more shapes (some providers pad every chunk differently)."""
        info = self.api.observe(ev, self.route)
        self.ex.event_seen(info, t)
        if (info.error_type is not None and self.kept is not None and self.splice is None
                and self.ex.t_first_token and self.held_error is None
                and not failures.request_error_type(info.error_type)):
            self.held_error = bytearray()  # the caller holds this event and what follows
        if self.kept is not None and info.token:
            said = self.api.continuation_text(ev)
            if said is None:  # reasoning, a tool call: no prefill can carry it on
                self.kept = self.ex.streamed_text = None
            else:
                self.kept.append(said[0])
                if self.ex.response_id is None:  # a stream without an opening chunk
                    self.ex.response_id = said[1]
        if self.capture is not None:
            if info.token:
                self._capture(ev)
        elif (info.visible and not info.has_facts and ev.event is None and self.shape_tries
              and self.kept is None and self.splice is None):
            if self.shape_from is not None:
                self.learn_shape()
            self.shape_from = ev, info
        return info

    def learn_shape(self) -> TokenShape | None:
        """The stream's token shape, taken now from the event that offered one (if any):
        the first, or the chunks changed around their text; after a few, no more shapes."""
        offered, self.shape_from = self.shape_from, None
        if offered is not None:
            shape = self.api.token_shape(offered[0], self.route, offered[1])
            if shape is not None:
                self.shape_tries -= 1
                self.shape = shape if self.shape_tries else None
        return self.shape

    def _capture(self, ev: SSEEvent) -> None:
        capture = self.capture
        assert capture is not None
        if self.captured < CAPTURE_LIMIT:
            text = self.api.output_text(ev)
            if text:
                capture.append(text)
                self.captured += len(text)


class Relay:
    """One streamed response: the upstream response of `ex.attempt` → the client.

    The body is relayed inside the upstream protocol's `data_received` (gateway/transport/wire.py):
    each decoded read goes through the Splicer and, once committed, straight to the client's
    transport; the commit itself (response head and the held bytes, one write) happens in the
    read that brings the first token. This coroutine only wakes when the sink asks it to
    (client back-pressure) and at the end; bytes keep their order (the upstream paused during
    a drain). Deadlines and a client that leaves cancel it, as before."""

    def __init__(self, request: web.Request, ex: Exchange, up: UpstreamResponse,
                 api: Api, headers: object, *, hold_until_first_token: bool,
                 watchdog: Watchdog, keepalive_s: float = 0.0,
                 capture: list[str] | None = None,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
                 splice: Splice | None = None, race: RaceClaim | None = None,
                 replay: Replay | None = None) -> None:
        self.request = request
        self.ex = ex
        self.up = up
        self.api = api
        self.headers = headers
        self.hold = hold_until_first_token
        self.watchdog = watchdog
        self.keepalive_s = keepalive_s
        self.splicer = Splicer(ex, api, capture, max_event_bytes, splice)
        self.max_event_bytes = max_event_bytes  # one event, and all that is held before commit
        self.held_bytes = 0
        self.held: list[bytes] = []  # before commit
        self.t_last_write = 0
        # A first-token race's: the commit claims it (a hedge may have had its token first).
        self.race = race
        # A hedge that won: its body and its reads so far, replayed with their times.
        self.replay = replay
        self.body = replay.body if replay is not None else UpstreamBody(up)
        # After commit: a continuation writes on to the response its first attempt began.
        self.wire = ClientWire(request, ex.response) if ex.response is not None else None
        # The response this attempt commits, its head serialised now (the upstream's head has
        # come; its first token, usually, not yet): the commit is then one write.
        self.response: CoalescedResponse | None = None
        self.prepared: PreparedHead | None = None
        if self.wire is None:
            self.response = CoalescedResponse(status=up.status, headers=headers)  # type: ignore[arg-type]
            self.prepared = prepare_head(self.response, request)
        self.tokens_before = ex.token_events  # the idle deadline starts at this one's first
        self.idle_armed = False
        self.choices = api.choices(ex.parsed)  # answers asked for, each with its finish reason
        # What the sink asks of the coroutine: a drain of the client's buffer (the upstream
        # paused meanwhile), then the end: _EOF, _LINGERED or an exception to raise.
        self.drain_asked = False
        self.end: object = None
        self.linger: asyncio.TimerHandle | None = None  # from the terminal event on
        self.waiter: asyncio.Future[None] | None = None

    # -- the sink: called from inside the upstream protocol's callbacks, never awaits ---------

    def body_data(self, chunk: bytes, at: int = 0) -> None:
        """One upstream read (`at`: when it arrived, for a hedge's replayed reads)."""
        if self.end is not None:
            return  # ending already (client gone, event too large): nothing more goes out
        ex = self.ex
        t = now_ns()
        try:
            out = self.splicer.feed(chunk, at or t)
            if not self.idle_armed and ex.token_events > self.tokens_before:
                self.watchdog.first_token()
                self.idle_armed = True
                if ex.on_first_token is not None:
                    ex.on_first_token()
                    ex.on_first_token = None
            wire = self.wire
            if wire is not None:
                if out:
                    if wire.send(out):
                        self.t_last_write = t
                        if wire.full:
                            self._drain_first()
                    else:
                        self._finish(ClientGone())
            else:
                if out:
                    self.held.append(out)
                    self.held_bytes += len(out)
                failed = (self._in_band_failure()
                          if ex.error_type and self.hold and not ex.t_first_token else None)
                if failed is not None:
                    self._finish(failed)
                elif not self.hold or ex.t_first_token or ex.done or ex.error_type:
                    # the first token leaves in the read that brought it
                    if self._commit() and self._client_wire().full:
                        self._drain_first()
                elif self.held_bytes + self.splicer.held_size > self.max_event_bytes:
                    self._finish(EventTooLarge(self.held_bytes + self.splicer.held_size,
                                               self.max_event_bytes,
                                               "answer without a first token"))
            if ex.done and self.linger is None and self.end is None:
                self._terminal()
            if self.splicer.shape_from is not None:  # after the write: off the token's path
                self.splicer.learn_shape()
        except EventTooLarge as e:  # raised by the coroutine, without this frame (a cycle)
            self._finish(e.with_traceback(None))
        except Exception as e:  # a bug of ours: raised by the coroutine, as before (never
            self._finish(e)  # into aiohttp's parser, which would blame the upstream)
        ex.overhead_ns += now_ns() - t

    def _in_band_failure(self) -> AttemptFailed | None:
        """An error event before any token, while the commit waits for one: an overload or a
        server error is a failed attempt (another replica may answer), so is a prompt too long
        for this model's context (a larger model may); the request's own error passes on as it
        came (None). Held, the event is the answer if no other attempt can be made."""
        ex = self.ex
        said = b"".join(self.held) + self.splicer.held_back()
        meaning = failures.in_band_error(said)
        if meaning == failures.REQUEST_ERROR:
            return None
        return AttemptFailed(
            ATTEMPT_CONTEXT_LENGTH if meaning == failures.CONTEXT_LENGTH else ATTEMPT_IN_BAND_ERROR,
            200, f"Backend '{ex.backend}' answered with an error before its first token.",
            ex.error_type or ATTEMPT_IN_BAND_ERROR, response=(200, self.headers, said),
            judges_backend=meaning == failures.BACKEND_ERROR)

    def _terminal(self) -> None:
        """The protocol's terminal event: the answer is complete, and its outcome and e2e are
        decided here (a client that leaves from now on did not cancel it). The upstream has
        TERMINAL_GRACE_S to end its body, as it should at once."""
        ex = self.ex
        if self.splicer.held_error is None:  # (a held error's end is decided by the proxy)
            if ex.error_type:  # an in-band error followed by [DONE] (vLLM) is still a failure
                ex.interruption = "upstream_error"
            ex.finish(UPSTREAM_ERROR if ex.error_type else OK)
        self.linger = asyncio.get_running_loop().call_later(
            TERMINAL_GRACE_S, self._finish, _LINGERED, False)

    def body_eof(self) -> None:
        self._finish(_EOF, pause=False)

    def body_error(self, exc: BaseException) -> None:
        self._finish(exc, pause=False)  # the body failed: nothing more will come

    def _drain_first(self) -> None:
        """The client's buffer is over its high-water mark: the upstream waits while the
        coroutine awaits its drain."""
        self.drain_asked = True
        self.body.pause()
        self._wake()

    def _finish(self, what: object, pause: bool = True) -> None:
        if self.end is None:
            self.end = what
        if pause:
            self.body.pause()
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the coroutine -------------------------------------------------------------------------

    def _commit(self) -> bool:
        """Send the response head and what was held, once, in one write (False: a race this
        attempt lost, nothing sent). Synchronous (no await:
        gateway/transport/wire.py's start_response), so it runs wherever commit is due — inside the
        upstream read that brought the first token, in the pinger, at the end — and nothing
        can come between the held bytes and the ones after them. The exchange's `response` is
        the commit state."""
        ex = self.ex
        if ex.response is not None:
            return True
        if self.race is not None and not self.race.primary_claims():
            # The hedge racing it had its token first: its watchdog has ended this attempt
            # already; this is only what the coroutine raises should it get that far.
            self._finish(deadline_failure(ATTEMPT_HEDGE_LOST))
            return False
        resp = self.response
        assert resp is not None  # (a continuation's is its first attempt's: committed)
        first, self.held, self.held_bytes = b"".join(self.held), [], 0
        ex.t_committed = now_ns()
        start_response(resp, self.request, first, self.prepared)
        ex.response = resp
        self.wire = ClientWire(self.request, resp)
        self.t_last_write = now_ns()
        return True

    async def _keepalive(self) -> None:
        """Comment pings while the client would otherwise see nothing (load balancers drop
        idle connections, LiteLLM #34819). Before commit, the first ping commits."""
        interval = self.keepalive_s
        self.t_last_write = now_ns()
        while True:
            await asyncio.sleep(max(0.0, interval - (now_ns() - self.t_last_write) / 1e9))
            if (now_ns() - self.t_last_write) / 1e9 < interval:
                continue
            try:
                if not self._commit():
                    return
                if self.wire is not None and not self.wire.send(PING):
                    return  # the reader finds out at its next write
            except ClientGone:
                return  # the reader finds out at its next write; nothing to ping any more
            self.t_last_write = now_ns()

    async def run(self) -> web.StreamResponse:
        pinger = None
        if self.keepalive_s > 0:
            pinger = asyncio.create_task(self._keepalive())
        try:
            return await self._run()
        finally:
            if pinger is not None:
                pinger.cancel()
            if self.linger is not None:
                self.linger.cancel()

    async def _pump(self) -> None:
        """Serve the sink's requests until the body ends; raise what ended it, if anything
        but its end."""
        body = self.body
        loop = asyncio.get_running_loop()
        replay, self.replay = self.replay, None
        if replay is None:
            body.hook(self)
        else:  # a hedge's reads first, in order, with their times; then its body goes on
            for chunk, t in replay.reads:
                self.body_data(chunk, t)
            body.hand_to(self)
            if replay.ended is True:
                self.body_eof()
            elif isinstance(replay.ended, BaseException):
                self.body_error(replay.ended)
            elif body.paused and not self.drain_asked and self.end is None:
                body.resume()  # paused by the probe when it won
        try:
            while True:
                if not self.drain_asked and self.end is None:
                    self.waiter = loop.create_future()
                    try:
                        await self.waiter
                    finally:
                        self.waiter = None
                if self.drain_asked:
                    self.drain_asked = False
                    paused = now_ns()
                    await self._client_wire().drain()
                    self.ex.client_paused_ns += now_ns() - paused
                end = self.end
                if end is not None:
                    if end is _EOF or end is _LINGERED:
                        return
                    assert isinstance(end, BaseException)
                    # The exception travels alone: kept here or in a local, it would pin this
                    # frame (and the exchange) in a reference cycle through its traceback.
                    self.end = _EOF
                    try:
                        raise end
                    finally:
                        del end
                body.resume()  # may run the sink again, re-entrantly
        finally:
            body.unhook()

    async def _run(self) -> web.StreamResponse:
        ex = self.ex
        try:
            await self._pump()
        except asyncio.CancelledError:
            reason = self.watchdog.claim()
            if reason is None:
                raise  # the client went away
            if ex.outcome is not None:  # a deadline while the upstream lingered: it is over
                return await self._eof()
            if not ex.t_committed:
                raise deadline_failure(reason) from None
            outcome = GATEWAY_ERROR if reason in (SHUTDOWN, PREEMPTED) else TIMEOUT
            return await self._end_with_error(reason, outcome, (
                "The stream was paused for another request and could not be continued."
                if reason == PREEMPTED else f"The stream was ended: {reason}."))
        except UpstreamLost:
            ex.error_type = "upstream_connection_lost"
        except EventTooLarge as e:
            return await self._too_large(e)
        held = self.splicer.held_error
        if held is not None:  # the backend's error after the first token: another may go on
            raise StreamBroken(ATTEMPT_IN_BAND_ERROR, ex.error_type or UPSTREAM_ERROR,
                               UPSTREAM_ERROR, "The upstream ended the stream with an error.",
                               ex.error_type or UPSTREAM_ERROR,
                               said=bytes(held))
        if ex.done or complete_at_eof(ex, self.choices):
            if not self._commit():
                raise deadline_failure(ATTEMPT_HEDGE_LOST)
            pending = self.splicer.held_back()
            if pending:
                await write(self._client(), pending)
            ex.finish(OK)  # complete at EOF (at the terminal event, decided there)
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

    def _client_wire(self) -> ClientWire:
        assert self.wire is not None, "committed"
        return self.wire

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
        API format: never a silent clean close (Portkey #1797). One that another backend
        may finish is handed back to the proxy to decide (StreamBroken)."""
        result = _BROKEN.get(reason) or (ATTEMPT_CUT if outcome == UPSTREAM_TRUNCATED else None)
        if result is not None and self.splicer.kept is not None:
            raise StreamBroken(result, reason, outcome, message, code or reason)
        return await end_with_error(self.ex, self.api, reason, outcome, message, code)

    async def _eof(self) -> web.StreamResponse:
        client = self._client()
        await write_eof(client)
        return client


def _count_as_received(ex: Exchange, tokens_before: int) -> None:
    """A continuation's usage as the answer's: the text it was given back was completion."""
    if ex.completion_tokens is not None:
        ex.completion_tokens += tokens_before
    if ex.prompt_tokens is not None:
        ex.prompt_tokens = max(0, ex.prompt_tokens - tokens_before)


# How a committed stream broke, by the reason it ended, where another backend may finish it.
_BROKEN = {IDLE: ATTEMPT_STALLED, EVENT_TOO_LARGE: EVENT_TOO_LARGE, PREEMPTED: PREEMPTED}


async def end_with_error(ex: Exchange, api: Api, reason: str, outcome: str, message: str,
                         code: str | None = None) -> web.StreamResponse:
    """End a committed stream with an error event in the client's API format."""
    ex.interruption = reason
    ex.finish(outcome, reason)
    client = ex.response
    assert client is not None, "committed"
    await write(client, api.stream_error_event(message, code or reason, ex.events))
    await write_eof(client)
    return client


async def end_as_said(ex: Exchange, said: bytes) -> web.StreamResponse:
    """End a committed stream with what the upstream itself said to end it (its error event,
    held back while another backend might have finished the answer)."""
    ex.interruption = UPSTREAM_ERROR
    ex.finish(UPSTREAM_ERROR)
    client = ex.response
    assert client is not None, "committed"
    await write(client, said)
    await write_eof(client)
    return client
