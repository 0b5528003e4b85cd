"""Replica health: a circuit breaker fed by request outcomes, and optional active checks."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from gateway.config import BreakerPolicy
from gateway.errors import UpstreamUnreachable
from gateway.transport.client import fetch

log = logging.getLogger("slogate.health")

CLOSED, HALF_OPEN, OPEN = 0, 1, 2


class Breaker:
    """Consecutive failures open it for a cooldown; then one request is let through as a
    probe, and its outcome closes or re-opens it."""

    __slots__ = ("policy", "state", "failures", "opened_at", "probing", "on_change", "clock")

    def __init__(self, policy: BreakerPolicy, on_change: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # monotonic seconds (a test passes its own)
        self.policy = policy
        self.state = CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.probing = False
        self.on_change = on_change

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
        self.failures = 0
        self.probing = False
        self._set(CLOSED)

    def failure(self) -> None:
        self.failures += 1
        self.probing = False
        if self.state == HALF_OPEN or self.failures >= self.policy.failures:
            self.opened_at = self.clock()
            self._set(OPEN)


async def check_forever(url: str, interval_s: float, session: aiohttp.ClientSession,
                        report: Callable[[bool], None]) -> None:
    """GET `url` every interval; 2xx is healthy, anything else (or no answer within the
    interval) is not."""
    while True:
        try:
            status, _ = await fetch(session, url, interval_s)
            ok = 200 <= status < 300  # a redirect is not followed: unhealthy
        except UpstreamUnreachable:
            ok = False
        report(ok)
        await asyncio.sleep(interval_s)
