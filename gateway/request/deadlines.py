"""The deadlines of one request, enforced by one timer (no per-read timer churn).

Reads only store a timestamp on the context (`t_last_event`); the timer re-arms itself when it
fires before a deadline has really passed. When one has, it records why and cancels the
request's task; the code that catches the CancelledError asks `fired` to tell a deadline (or a
drain) from a client that went away. The timer is moved only when a deadline comes due earlier
than it is set for; a later one is left to its check, which re-arms (most requests end long
before any deadline: one timer serves the whole request).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.errors import FIRST_TOKEN, IDLE, SHUTDOWN, TOTAL, GatewayError
from gateway.timeline import now_ns

if TYPE_CHECKING:
    from gateway.config import Timeouts
    from gateway.exchange import Exchange

__all__ = ["FIRST_TOKEN", "IDLE", "SHUTDOWN", "TOTAL", "DeadlineOverrides", "Watchdog"]


class Timer(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    """What the watchdog needs of an event loop (tests pass one that runs on a fake clock)."""

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer: ...


class Watchdog:
    __slots__ = ("ctx", "task", "loop", "first_token_at", "idle_ns", "total_at", "handle",
                 "armed_at", "fired", "clock", "awaiting")

    def __init__(self, ctx: Exchange, total_at: int, idle_s: float, *,
                 first_check_s: float | None = None,
                 clock: Callable[[], int] = now_ns, loop: Scheduler | None = None) -> None:
        """`clock` (monotonic ns) and `loop` (where the timer is set) are the real ones unless a
        test drives time itself. `first_check_s`: when the timer first checks, at the latest
        (the proxy passes the first-token deadline the first attempt is likely to get, so that
        `attempt` finds the timer already due no later and leaves it be; an early check only
        re-arms)."""
        self.ctx = ctx
        running = asyncio.get_running_loop()
        self.task = asyncio.current_task(running)
        self.loop: Scheduler = loop if loop is not None else running
        self.clock = clock
        self.total_at = total_at
        self.first_token_at = total_at
        self.idle_ns = int(idle_s * 1e9)
        self.handle: Timer | None = None
        self.armed_at = 0  # when the timer in `handle` is due (monotonic ns)
        self.fired: str | None = None
        self.awaiting = False  # a continuation's first token is still to come
        if first_check_s is None:
            self._arm()
        else:
            self._arm(min(self.clock() + int(first_check_s * 1e9), total_at))

    def attempt(self, first_token_s: float, idle_s: float, continuing: bool = False) -> None:
        """A new upstream attempt starts now: its own first-token deadline (and idle gap). A
        deadline that ended the previous attempt was claimed (that attempt failed over): this
        one is watched afresh. A continuation awaits a first token of its own, although the
        answer it goes on with had one."""
        self.fired = None
        self.awaiting = continuing
        self.first_token_at = min(self.clock() + int(first_token_s * 1e9), self.total_at)
        self.idle_ns = int(idle_s * 1e9)
        self._arm()

    def first_token(self) -> None:
        """The first token arrived: from now on the idle gap is what can run out (it may be
        due earlier than the first-token deadline the timer was set for). A token stamped
        after the deadline is late even if its read ran before the timer's callback (a loop
        that stalled past both runs I/O first): the stamp decides, not the callback order."""
        if self.ctx.t_first_token > self.first_token_at:
            self.fire(FIRST_TOKEN)
            return
        self.awaiting = False
        self._arm()

    def _due(self) -> int:
        ctx = self.ctx
        if not ctx.t_first_token or self.awaiting:
            return min(self.first_token_at, self.total_at)
        return min(max(ctx.t_last_event, ctx.t_first_token) + self.idle_ns, self.total_at)

    def _arm(self, due: int | None = None) -> None:
        """Have the timer check no later than the next deadline (or `due`, when earlier)."""
        due = self._due() if due is None else min(due, self._due())
        if self.handle is not None:
            if self.armed_at <= due:
                return  # it checks first, and re-arms for what is due then
            self.handle.cancel()
        self.armed_at = due
        self.handle = self.loop.call_later(max(0.0, (due - self.clock()) / 1e9), self._check)

    def _check(self) -> None:
        self.handle = None  # this timer has run: `_arm` sets a new one
        if self.fired is not None:
            return
        now = self.clock()
        ctx = self.ctx
        if now >= self.total_at:
            self.fire(TOTAL)
        elif not ctx.t_first_token or self.awaiting:
            if now >= self.first_token_at:
                self.fire(FIRST_TOKEN)
            else:
                self._arm()
        elif now >= max(ctx.t_last_event, ctx.t_first_token) + self.idle_ns:
            self.fire(IDLE)
        else:
            self._arm()

    def fire(self, reason: str) -> None:
        """End the request now for `reason` (a deadline, or the gateway shutting down)."""
        if self.fired is None and self.task is not None and not self.task.done():
            self.fired = reason
            self.task.cancel()

    def claim(self) -> str | None:
        """In an `except CancelledError`: the reason if this watchdog caused it (the task is
        un-cancelled so the request can still answer), None if the client went away."""
        if self.fired is not None and self.task is not None:
            self.task.uncancel()
        return self.fired

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


_OVERRIDE_NAMES = ("connect", "first_token", "idle", "total")


@dataclass(frozen=True, slots=True)
class DeadlineOverrides:
    """What a request asked for with `x-slogate-timeout-<name>-ms` headers, parsed once (in
    classify): each may tighten a backend's deadline, never extend it."""
    connect_s: float | None = None
    first_token_s: float | None = None
    idle_s: float | None = None
    total_s: float | None = None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str],
                     allowed: bool = True) -> DeadlineOverrides:
        """The overrides asked for; 403 when the tenant's key may not send any (`allowed`)."""
        values: dict[str, float] = {}
        for name in _OVERRIDE_NAMES:
            header = f"x-slogate-timeout-{name.replace('_', '-')}-ms"
            raw = headers.get(header)
            if raw is None:
                continue
            if not allowed:
                raise GatewayError(403, f"This key may not send {header}.",
                                   "timeout_override_not_allowed", outcome="rejected")
            try:
                ms = float(raw)
            except ValueError:
                ms = float("nan")
            if not ms >= 1:  # also rejects NaN
                raise GatewayError(400, f"{header} must be a number of milliseconds >= 1.",
                                   "invalid_timeout_header")
            values[name + "_s"] = ms / 1e3
        return cls(**values) if values else NO_OVERRIDES

    def apply(self, timeouts: Timeouts) -> Timeouts:
        """`timeouts`, tightened where this request asked for less."""
        if self is NO_OVERRIDES:
            return timeouts
        from dataclasses import replace

        return replace(timeouts, **{
            name + "_s": min(getattr(timeouts, name + "_s"), mine)
            for name in _OVERRIDE_NAMES if (mine := getattr(self, name + "_s")) is not None})

    @property
    def any(self) -> bool:
        return self is not NO_OVERRIDES

    def tightened(self, timeouts: Timeouts, applied: Timeouts) -> bool:
        """Did this request make `applied` tighter than the server's own `timeouts`? Then a
        deadline it hits is the client's choice and says nothing about the backend."""
        return self.any and applied != timeouts


NO_OVERRIDES = DeadlineOverrides()
