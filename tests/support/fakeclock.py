"""A monotonic clock that moves only when a test moves it, with timers on it.

`FakeClock()` is the clock (`clock()` -> ns, `clock.seconds()` -> s) and a stand-in for the
event loop's `call_later`; `advance(s)` moves time forward and runs every timer that falls due,
in order, at its due time. Nothing sleeps: a test states the exact instant a deadline fires.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable


class FakeTimer:
    __slots__ = ("when", "seq", "callback", "cancelled")

    def __init__(self, when: int, seq: int, callback: Callable[[], object]) -> None:
        self.when = when
        self.seq = seq
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    def __init__(self, start_s: float = 1000.0) -> None:
        self.ns = round(start_s * 1e9)
        self._timers: list[FakeTimer] = []
        self._seq = itertools.count()

    def __call__(self) -> int:
        return self.ns

    def seconds(self) -> float:
        return self.ns / 1e9

    def call_later(self, delay: float, callback: Callable[[], object]) -> FakeTimer:
        timer = FakeTimer(self.ns + max(0, round(delay * 1e9)), next(self._seq), callback)
        self._timers.append(timer)
        return timer

    def pending(self) -> list[FakeTimer]:
        return sorted((t for t in self._timers if not t.cancelled),
                      key=lambda t: (t.when, t.seq))

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, running each timer that falls due on the way."""
        end = self.ns + round(seconds * 1e9)
        for _ in range(10_000):
            due = [t for t in self.pending() if t.when <= end]
            if not due:
                self.ns = end
                return
            timer = due[0]
            self._timers.remove(timer)
            self.ns = max(self.ns, timer.when)
            timer.callback()
        raise AssertionError("timers keep re-arming without time passing")
