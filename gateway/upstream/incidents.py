"""The operator's log of each backend's health: one warning when it starts failing, when its
circuit opens or closes, when an active check fails or recovers, each with its cause in words.

Rate-limited per backend and kind (at most one line every `INTERVAL_S`), so an outage is a few
lines rather than one per request or probe; a line held back is counted and told with the next
line of its kind ("(3 more since)"). Every line has a counter that carries it whatever the rate
limit held back (telemetry/prometheus.py): upstream_attempts_total{result} for failures,
breaker_transitions_total{to} for the circuit, tenant_backend_holds_total for a tenant held
off, health_check_failures_total and backend_healthy for the active checks.

Each line is also structured: the record carries `event` (one of the kinds below), `backend`
and `detail` (the cause, or how long the backend was down), for a handler that writes JSON.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("slogate.health")

INTERVAL_S = 10.0

FAILING = "backend_failing"
CIRCUIT_OPEN = "circuit_open"
CIRCUIT_CLOSED = "circuit_closed"
CHECK_FAILED = "health_check_failed"
CHECK_RECOVERED = "health_check_recovered"
TENANT_HELD = "tenant_held"


class Throttle:
    """At most one line per kind every `interval_s`; the lines held back are counted."""

    __slots__ = ("interval_s", "clock", "_last", "_held")

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, kind: str) -> int | None:
        """None: hold this line back; else how many of its kind were held back before it."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return None
        self._last[kind] = now
        return self._held.pop(kind, 0)


def seconds(s: float) -> str:
    """A duration as an operator reads it: `0.4 s`, `12 s`, `3 min 20 s`."""
    if s < 10:
        return f"{s:.1f} s"
    if s < 120:
        return f"{s:.0f} s"
    return f"{int(s // 60)} min {int(s % 60)} s"


class BackendLog:
    """One backend's health lines, each a warning on `slogate.health`."""

    __slots__ = ("backend", "throttle")

    def __init__(self, backend: str, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = INTERVAL_S) -> None:
        self.backend = backend
        self.throttle = Throttle(interval_s, clock)

    def _warn(self, kind: str, message: str, detail: str) -> None:
        held = self.throttle.allow(kind)
        if held is None:
            return
        if held:
            message += f" ({held} more since)"
        log.warning("backend '%s' %s", self.backend, message,
                    extra={"event": kind, "backend": self.backend, "detail": detail})

    def failing(self, cause: str) -> None:
        """The first failure after a success (the circuit is still closed)."""
        self._warn(FAILING, f"is failing: {cause}", cause)

    def opened(self, failures: int, cooldown_s: float, cause: str, probe: bool,
               witness: str | None = None, confirmed: bool = False) -> None:
        """The circuit opened: after `failures` in a row, because its probe failed, or because
        a second tenant's request failed while it was open on one tenant's (`witness`)."""
        why = ("its probe failed" if probe
               else "a second tenant's request failed too" if confirmed
               else "after 1 failure" if failures == 1
               else f"after {failures} failures in a row")
        if witness is not None:
            why += f", all tenant '{witness}''s: other tenants' requests still go there"
        self._warn(CIRCUIT_OPEN, f"is unavailable: circuit open for {seconds(cooldown_s)} "
                   f"({why}; last: {cause})", cause)

    def tenant_held(self, tenant: str, failures: int, cooldown_s: float, cause: str) -> None:
        """One tenant's requests fail here while other tenants' succeed: it alone is held
        off (the circuit stays closed for the others)."""
        self._warn(TENANT_HELD, f"fails tenant '{tenant}' only: its requests are held off for "
                   f"{seconds(cooldown_s)}, other tenants' still go there ({failures} failures "
                   f"in a row while another tenant's request succeeded; last: {cause})", cause)

    def closed(self, down_s: float) -> None:
        """A request succeeded on it again: the circuit closed."""
        self._warn(CIRCUIT_CLOSED, f"recovered: circuit closed ({seconds(down_s)} after its "
                   "first failure)", seconds(down_s))

    def check_failed(self, reason: str) -> None:
        self._warn(CHECK_FAILED, f"failed its health check: {reason}", reason)

    def check_recovered(self, down_s: float) -> None:
        self._warn(CHECK_RECOVERED, f"passes its health check again (after "
                   f"{seconds(down_s)})", seconds(down_s))
