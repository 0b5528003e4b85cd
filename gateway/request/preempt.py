"""A committed stream that admission may preempt (admission/preemption.py), as it sees it."""
from __future__ import annotations

from collections.abc import Callable

from gateway.admission.preemption import MAX_PREEMPTIONS, Streaming
from gateway.errors import PREEMPTED
from gateway.exchange import Exchange
from gateway.request.deadlines import Watchdog
from gateway.timeline import now_ns


class PreemptibleStream:
    """One request's stream: preemptible while it streams tokens (not while a continuation
    awaits its first), up to MAX_PREEMPTIONS times, and while it could be continued (the
    proxy's rule: a backend that continues a prefill, one choice, text only so far)."""

    __slots__ = ("ex", "watchdog", "may_continue")

    def __init__(self, ex: Exchange, watchdog: Watchdog,
                 may_continue: Callable[[Exchange], bool]) -> None:
        self.ex = ex
        self.watchdog = watchdog
        self.may_continue = may_continue

    def streaming(self) -> Streaming | None:
        ex, watchdog = self.ex, self.watchdog
        if (not ex.t_first_token or not ex.t_committed or ex.outcome is not None or ex.done
                or ex.streamed_text is None or ex.race is not None or ex.attempt is None
                or ex.preempted >= MAX_PREEMPTIONS
                or watchdog.fired is not None or watchdog.awaiting
                or not self.may_continue(ex)):
            return None
        # its wait for a slot again runs against its continuation's first-token deadline
        # (proxy._resume) and its total one
        left_s = (watchdog.total_at - now_ns()) / 1e9
        return Streaming(ex.t_first_token, ex.token_events,
                         min(ex.attempt.timeouts.first_token_s, left_s))

    def preempt(self) -> None:
        self.ex.preempted += 1
        self.watchdog.fire(PREEMPTED)
