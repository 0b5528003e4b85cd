"""Replica health: a circuit breaker fed by request outcomes, and optional active checks."""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import aiohttp
from yarl import URL

from gateway.config import BreakerPolicy
from gateway.errors import UpstreamUnreachable
from gateway.transport.client import fetch
from gateway.upstream.incidents import BackendLog, seconds

CLOSED, HALF_OPEN, OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", HALF_OPEN: "half_open", OPEN: "open"}


class Breaker:
    """Consecutive failures open it for a cooldown; then one request is let through as a
    probe, and its outcome closes or re-opens it. It remembers its last failure (the cause in
    words, and when), so that an answer or a log line can say why a backend is unavailable."""

    __slots__ = ("policy", "state", "failures", "opened_at", "probing", "on_change", "clock",
                 "last_cause", "last_failure_at", "failing_since", "log")

    def __init__(self, policy: BreakerPolicy, on_change: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic,
                 log: BackendLog | None = None) -> None:
        self.clock = clock  # monotonic seconds (a test passes its own)
        self.policy = policy
        self.state = CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.probing = False
        self.on_change = on_change
        self.last_cause = ""
        self.last_failure_at = 0.0
        self.failing_since = 0.0  # the first of the current run of failures
        self.log = log

    def _set(self, state: int) -> None:
        if state != self.state:
            self.state = state
            self.on_change(state)

    def available(self, now: float | None = None) -> bool:
        """Could a request go here now (without claiming the half-open probe)?"""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return (now or self.clock()) - self.opened_at >= self.policy.cooldown_s
        return not self.probing

    def acquire(self) -> bool:
        """Claim this replica for a request; False if the breaker forbids it."""
        if self.state == CLOSED:
            return True
        now = self.clock()
        if self.state == OPEN and now - self.opened_at >= self.policy.cooldown_s:
            self._set(HALF_OPEN)
            self.probing = False
        if self.state == HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def retry_after_s(self) -> float:
        if self.state != OPEN:
            return 1.0
        return max(0.0, self.policy.cooldown_s - (self.clock() - self.opened_at))

    def release(self) -> None:
        """The probe ended without saying anything about the replica's health (a rate limit,
        the drain, a client that left): the next request may probe."""
        self.probing = False

    def success(self) -> None:
        if self.state != CLOSED and self.log is not None:
            self.log.closed(self.clock() - self.failing_since)
        self.failures = 0
        self.probing = False
        self._set(CLOSED)

    def failure(self, cause: str = "") -> None:
        """A request failed here; `cause` says why in words (`127.0.0.1:9: connection
        refused`, `status 503`)."""
        now = self.clock()
        if self.failures == 0:
            self.failing_since = now
        self.failures += 1
        self.last_cause, self.last_failure_at = cause or "unknown cause", now
        self.probing = False
        was = self.state
        if was == HALF_OPEN or self.failures >= self.policy.failures:
            self.opened_at = now
            self._set(OPEN)
            if was != OPEN and self.log is not None:
                self.log.opened(self.failures, self.policy.cooldown_s, self.last_cause,
                                probe=was == HALF_OPEN)
        elif self.failures == 1 and self.log is not None:
            self.log.failing(self.last_cause)

    def why_unavailable(self) -> str:
        """Why no request may go here now, in words, with its last failure:
        `circuit open for another 4 s after 5 failures; last failure 1.2 s ago: …`."""
        now = self.clock()
        if self.state == OPEN:
            state = (f"circuit open for another {max(1, math.ceil(self.retry_after_s()))} s "
                     f"after {self.failures} failure{'' if self.failures == 1 else 's'}")
        elif self.state == HALF_OPEN:
            state = "circuit half-open: one request is testing whether it recovered"
        else:
            state = "circuit closed"
        if not self.last_failure_at:
            return state
        return (f"{state}; last failure {seconds(now - self.last_failure_at)} ago: "
                f"{self.last_cause}")


async def check_forever(url: str, interval_s: float, session: aiohttp.ClientSession,
                        report: Callable[[str], None]) -> None:
    """GET `url` every interval; 2xx is healthy (reported as ""), anything else is not, and is
    reported in words: `/health: status 500`, `127.0.0.1:9: connection refused`, `…: timed
    out` (no answer within the interval)."""
    path = URL(url).path
    while True:
        try:
            status, _ = await fetch(session, url, interval_s)
            # A redirect is not followed: unhealthy.
            report("" if 200 <= status < 300 else f"{path}: status {status}")
        except UpstreamUnreachable as e:
            report(str(e))
        await asyncio.sleep(interval_s)
