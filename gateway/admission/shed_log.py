"""The operator's lines for overload: one warning when admission starts refusing requests
(shedding: a full queue, a TTFT target that cannot be met now) and one when it has stopped —
that is, when a request is admitted after `QUIET_S` without a refusal — with how many it
refused meanwhile and why. Two lines per episode, however long; the per-request count is
slogate_admission_decisions_total{decision="rejected",reason} and
slogate_tenant_sheds_total{reason}."""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from gateway.upstream.incidents import seconds

log = logging.getLogger("slogate.admission")

QUIET_S = 10.0
SHEDDING_STARTED, SHEDDING_STOPPED = "shedding_started", "shedding_stopped"


class ShedLog:
    __slots__ = ("clock", "quiet_s", "since", "last", "reasons")

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 quiet_s: float = QUIET_S) -> None:
        self.clock = clock
        self.quiet_s = quiet_s
        self.since: float | None = None  # when this episode of shedding began
        self.last = 0.0  # its latest refusal
        self.reasons: Counter[str] = Counter()

    def refused(self, reason: str) -> None:
        now = self.clock()
        if self.since is None:
            self.since = now
            self.reasons.clear()
            log.warning("admission started refusing requests: %s", reason,
                        extra={"event": SHEDDING_STARTED, "detail": reason})
        self.last = now
        self.reasons[reason] += 1

    def admitted(self) -> None:
        if self.since is None:
            return
        now = self.clock()
        if now - self.last < self.quiet_s:
            return
        why = ", ".join(f"{n} {reason}" for reason, n in self.reasons.most_common())
        log.warning("admission stopped refusing requests: %d refused in %s (%s)",
                    sum(self.reasons.values()), seconds(self.last - self.since), why,
                    extra={"event": SHEDDING_STOPPED, "detail": why})
        self.since = None
