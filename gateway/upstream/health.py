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


class Hold:
    """A tenant held off a replica by its own failures: other tenants' requests succeed there."""

    __slots__ = ("since", "failures", "probing")

    def __init__(self, since: float, failures: int) -> None:
        self.since = since
        self.failures = failures  # its failures in a row here when it was held (renewed)
        self.probing = False  # one of its requests is testing whether they work again


class Breaker:
    """Failures open it for a cooldown; then one request is let through as a probe, and its
    outcome closes or re-opens it. It remembers its last failure (the cause in words, and
    when), so that an answer or a log line can say why a backend is unavailable.

    A backend is judged only by what says something about the backend, so every outcome comes
    with the tenant whose request it was (`tenant`: a bounded label), and a failure that one
    tenant alone sees is that tenant's, not the replica's:
    - `policy.failures` failures in a row (since anyone's last success) from two or more
      tenants open it for everyone.
    - The same from one tenant alone open it on that tenant's word (`opened_by`): that tenant
      is refused, other tenants' requests still go there, and the first of them decides: a
      success closes it and holds the witness off (below), a failure opens it for everyone.
      With a single tenant (open mode) this is the classic breaker.
    - A tenant whose own `policy.failures` requests in a row failed here while other tenants'
      succeeded is held off this replica for the cooldown, then one of its requests probes
      for it (`Hold`). The replica stays closed for everyone else.
    `tenant=None` (the default of the read-only calls) asks about the replica as a whole."""

    __slots__ = ("policy", "state", "failures", "opened_at", "probing", "on_change", "clock",
                 "last_cause", "last_failure_at", "failing_since", "log", "witnesses",
                 "opened_by", "streaks", "holds", "on_hold", "seen")

    def __init__(self, policy: BreakerPolicy, on_change: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic,
                 log: BackendLog | None = None,
                 on_hold: Callable[[str], None] | None = None) -> None:
        self.clock = clock  # monotonic seconds (a test passes its own)
        self.policy = policy
        self.state = CLOSED
        self.failures = 0  # in a row, whoever's: since the last success of any tenant
        self.opened_at = 0.0
        self.probing: str | None = None  # the tenant whose request holds the half-open probe
        self.on_change = on_change
        self.last_cause = ""
        self.last_failure_at = 0.0
        self.failing_since = 0.0  # the first of the current run of failures
        self.log = log
        self.witnesses: dict[str, int] = {}  # the tenants of those failures, and how many
        self.opened_by: str | None = None  # open on this one tenant's failures alone
        self.streaks: dict[str, int] = {}  # each tenant's own failures in a row here
        self.holds: dict[str, Hold] = {}
        self.on_hold = on_hold  # a tenant was held off (counted)
        self.seen: set[str] = set()  # the tenants whose requests came here (to name one)

    def _set(self, state: int) -> None:
        if state != self.state:
            self.state = state
            self.on_change(state)

    def _tester(self, tenant: str | None) -> bool:
        """Open on another tenant's word only: this tenant's requests still go here."""
        return (tenant is not None and self.opened_by is not None and tenant != self.opened_by
                and self.state != CLOSED)

    def _held(self, tenant: str | None, now: float) -> Hold | None:
        """The tenant's hold, while it refuses the tenant's requests."""
        hold = self.holds.get(tenant) if tenant is not None else None
        if hold is not None and (now - hold.since < self.policy.cooldown_s or hold.probing):
            return hold
        return None

    def held(self, tenant: str) -> bool:
        """Is this tenant held off here now by its own failures?"""
        return self._held(tenant, self.clock()) is not None

    def available(self, now: float | None = None, tenant: str | None = None) -> bool:
        """Could a request (of `tenant`) go here now (without claiming a probe)?"""
        if self.state == CLOSED and not self.holds:  # the usual case, on every request
            return True
        now = now or self.clock()
        if self._held(tenant, now) is not None:
            return False
        if self.state == CLOSED or self._tester(tenant):
            return True
        if self.state == OPEN:
            return now - self.opened_at >= self.policy.cooldown_s
        return self.probing is None

    def acquire(self, tenant: str = "") -> bool:
        """Claim this replica for a request of `tenant`; False if the breaker forbids it."""
        if self.state == CLOSED and not self.holds:
            return True
        now = self.clock()
        if self._held(tenant, now) is not None:
            return False
        granted = self.state == CLOSED or self._tester(tenant)
        if not granted:
            if self.state == OPEN and now - self.opened_at >= self.policy.cooldown_s:
                self._set(HALF_OPEN)
                self.probing = None
            if self.state == HALF_OPEN and self.probing is None:
                self.probing, granted = tenant, True
        hold = self.holds.get(tenant)
        if granted and hold is not None:
            hold.probing = True  # its hold is over: this request tests it
        return granted

    def probing_for(self, tenant: str) -> bool:
        """Does a request of this tenant hold a probe here (the half-open one or its hold's)?"""
        hold = self.holds.get(tenant)
        return ((self.state == HALF_OPEN and self.probing == tenant)
                or (hold is not None and hold.probing))

    def retry_after_s(self, tenant: str | None = None) -> float:
        now = self.clock()
        hold = self._held(tenant, now)
        held = self.policy.cooldown_s - (now - hold.since) if hold is not None else 0.0
        if self.state != OPEN or self._tester(tenant):
            return max(held, 1.0 if hold is None else 0.0)
        return max(held, self.policy.cooldown_s - (now - self.opened_at))

    def release(self, tenant: str = "") -> None:
        """The probe ended without saying anything about the replica's health (a rate limit,
        the drain, a client that left): the next request may probe."""
        if self.probing == tenant:
            self.probing = None
        hold = self.holds.get(tenant)
        if hold is not None:
            hold.probing = False

    def _witness(self) -> str | None:
        """The tenant it is open on the word of, when it is worth naming (others use it)."""
        return self.opened_by if len(self.seen) > 1 else None

    def success(self, tenant: str = "") -> None:
        now = self.clock()
        self.seen.add(tenant)
        self.streaks.pop(tenant, None)
        self.holds.pop(tenant, None)  # its own requests work here again
        if self.state != CLOSED:
            witness = self.opened_by
            if witness is not None and tenant != witness:
                # Open on one tenant's word, and another tenant's request succeeds: those
                # failures were that tenant's own.
                self._hold(witness, now, self.streaks.get(witness, self.failures))
            elif self.log is not None:
                self.log.closed(now - self.failing_since)
        self.failures = 0
        self.witnesses.clear()
        self.opened_by = self.probing = None
        self._set(CLOSED)

    def failure(self, cause: str = "", tenant: str = "") -> None:
        """A request of `tenant` failed here; `cause` says why in words (`127.0.0.1:9:
        connection refused`, `status 503`)."""
        now = self.clock()
        self.seen.add(tenant)
        if self.failures == 0:
            self.failing_since = now
        self.failures += 1
        self.witnesses[tenant] = self.witnesses.get(tenant, 0) + 1
        streak = self.streaks[tenant] = self.streaks.get(tenant, 0) + 1
        self.last_cause, self.last_failure_at = cause or "unknown cause", now
        if self.probing == tenant:
            self.probing = None
        hold = self.holds.get(tenant)
        if hold is not None:  # its probe failed (or a request sent before the hold): renewed
            hold.since, hold.failures, hold.probing = now, streak, False
        was = self.state
        if was != CLOSED:
            if self._tester(tenant):  # a second tenant sees it fail: it is the backend's
                self.opened_by = None
                self.opened_at = now
                self._set(OPEN)
                if self.log is not None:
                    self.log.opened(self.failures, self.policy.cooldown_s, self.last_cause,
                                    probe=False, confirmed=True)
                return
            self.opened_at = now
            self._set(OPEN)
            if was == HALF_OPEN and self.log is not None:
                self.log.opened(self.failures, self.policy.cooldown_s, self.last_cause,
                                probe=True)
        elif self.failures >= self.policy.failures:
            self.opened_by = tenant if len(self.witnesses) == 1 else None
            self.opened_at = now
            self._set(OPEN)
            if self.log is not None:
                self.log.opened(self.failures, self.policy.cooldown_s, self.last_cause,
                                probe=False, witness=self._witness())
        elif streak >= self.policy.failures and hold is None:
            # Its own failures in a row, while other tenants' successes came in between.
            self._hold(tenant, now, streak)
        elif self.failures == 1 and self.log is not None:
            self.log.failing(self.last_cause)

    def _hold(self, tenant: str, now: float, failures: int) -> None:
        self.holds[tenant] = Hold(now, failures)
        if self.on_hold is not None:
            self.on_hold(tenant)
        if self.log is not None:
            self.log.tenant_held(tenant, failures, self.policy.cooldown_s, self.last_cause)

    def why_unavailable(self, tenant: str | None = None) -> str:
        """Why no request (of `tenant`) may go here now, in words, with its last failure:
        `circuit open for another 4 s after 5 failures; last failure 1.2 s ago: …`."""
        now = self.clock()
        hold = self._held(tenant, now)
        if hold is not None:
            state = (f"held off for this tenant for another "
                     f"{max(1, math.ceil(self.retry_after_s(tenant)))} s: its last "
                     f"{hold.failures} requests there failed while other tenants' succeeded")
        elif self.state == OPEN:
            state = (f"circuit open for another {max(1, math.ceil(self.retry_after_s()))} s "
                     f"after {self.failures} failure{'' if self.failures == 1 else 's'}")
            if self._witness() is not None:
                state += ", all one tenant's (other tenants' requests still go there)"
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
