"""Preemption: a running stream gives its slot to an arrival of a class short of its share.

A continuous-batching engine does not preempt at its batch limit (vLLM's priority scheduling
preempts only under KV-cache pressure), and a tight TTFT target cannot wait for a slot to
free: with every slot held by a flooding class, a small class's arrivals beyond its mean need
(Poisson bursts) were refused although its share was its due. The gateway can preempt itself,
with the continuation it already has for streams cut by a fault: the stream of a class over
its share is cut, its slot goes to the arrival at once, and its answer so far is continued
(prompt plus the text so far, a backend with `continuation = "prefill"`) when the next slot
frees, ahead of every queued request. Its client sees a pause, which its TPOT slack absorbs.

Who may take from whom: a class that asks less than its weighted part of the slots (its fair
share, admission/reserve.py, is what it needs) from one that asks more, while the taker's
slots in flight averaged over USAGE_TAU_S are under its share. A Poisson class needs more than
its mean at times, and one whose average is under its share is owed those slots. A stream is
preempted at most MAX_PREEMPTIONS times, only after its first token, only when its remaining
decode would not free the slot in time anyway, and only when its TPOT target leaves room for
the pause (the wait for the next release and the re-prefill of its prompt and text so far) by
PAUSE_MARGIN.

Pure: the controller passes the clock's time and the counts.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

MAX_PREEMPTIONS = 2  # a stream gives its slot at most this often
USAGE_TAU_S = 10.0  # a class's slots in flight are averaged over this long
MARGIN = 0.05  # the taker must be this much (a fraction of its share) less served
PAUSE_MARGIN = 1.5  # a victim's TPOT slack must cover its predicted pause this many times


class ClassUsage:
    """Each SLO class's slots in flight, and their exponentially weighted time average."""

    __slots__ = ("count", "avg", "at", "tau_s")

    def __init__(self, tau_s: float = USAGE_TAU_S) -> None:
        self.tau_s = tau_s
        self.count: Counter[str] = Counter()
        self.avg: dict[str, float] = {}
        self.at: dict[str, float] = {}

    def change(self, cls: str, delta: int, now_s: float) -> None:
        """`cls` took (`delta` 1) or freed (-1) a slot at `now_s`."""
        self._advance(cls, now_s)
        self.count[cls] += delta

    def mean(self, cls: str, now_s: float) -> float:
        self._advance(cls, now_s)
        return self.avg.get(cls, 0.0)

    def _advance(self, cls: str, now_s: float) -> None:
        last = self.at.get(cls)
        self.at[cls] = now_s
        if last is None:
            self.avg[cls] = 0.0
            return
        keep = math.exp(-max(0.0, now_s - last) / self.tau_s)
        self.avg[cls] = self.count[cls] + keep * (self.avg[cls] - self.count[cls])


@dataclass(frozen=True, slots=True)
class Streaming:
    """A stream that could be preempted now, as its proxy sees it."""
    t_first_ns: int  # its first token's stamp (monotonic)
    tokens: int  # output tokens streamed so far
    max_pause_s: float  # the longest its deadlines let it wait for a slot again


class Preemptible(Protocol):
    """A committed stream, as admission sees it (the proxy's request/preempt.py)."""

    def streaming(self) -> Streaming | None:
        """What admission weighs it on while it could be preempted now and continued; else
        None."""

    def preempt(self) -> None:
        """Cut its upstream attempt now: the proxy continues its answer once admission gives
        it a slot again (AdmissionController.resume)."""


def may_take(taker: str, victim: str, share: Mapping[str, float],
             weight: Mapping[str, float], usage: Mapping[str, float]) -> bool:
    """May a request of `taker` take a slot from a stream of `victim`? The taker must be
    under its fair share on average (by MARGIN). A class entitled to less per unit of weight
    than the victim (it asks less than its weighted part: water-filling gave it what it needs)
    may take from one that asks more, never the other way: the flooding class's share
    includes the slots held for the other, so it reads as under its share and would take them
    back. Between classes entitled alike, the less served (average slots over share, by
    MARGIN) takes. A victim whose class has no share now (its demand stopped) gives any."""
    own = share.get(taker, 0.0)
    if taker == victim or own <= 0.0 or usage.get(taker, 0.0) >= (1.0 - MARGIN) * own:
        return False
    theirs = share.get(victim, 0.0)
    if theirs <= 0.0:
        return usage.get(victim, 0.0) > 0.0
    level, their_level = own / weight.get(taker, 1.0), theirs / weight.get(victim, 1.0)
    if level < (1.0 - MARGIN) * their_level:
        return True
    if their_level < (1.0 - MARGIN) * level:
        return False
    return usage.get(taker, 0.0) / own + MARGIN < usage.get(victim, 0.0) / theirs


@dataclass(frozen=True, slots=True)
class Running:
    """A stream that could give its slot: what its slack is judged on."""
    decoded_s: float  # since its first token
    tokens: int  # output tokens it has streamed
    out_tokens: float  # its output length as known (max_tokens) or expected
    tpot_target_s: float
    tpot_s: float  # predicted time per token where it runs
    max_pause_s: float = math.inf  # what its deadlines allow (Streaming.max_pause_s)


def slack_s(r: Running) -> float:
    """How much longer its stream may pause and still meet its TPOT target, predicted: the
    decode time its target allows over its length, less what it has run and what is left."""
    left = max(0.0, r.out_tokens - r.tokens)
    return r.tpot_target_s * max(0.0, r.out_tokens - 1) - r.decoded_s - left * r.tpot_s


def may_pause(r: Running, pause_s: float, needed_by_s: float) -> bool:
    """May this stream pause for `pause_s` so an arrival can start now? Not when it would end
    within `needed_by_s` anyway (its slot frees in time for the arrival), nor when its slack,
    or what its deadlines allow, does not cover the pause by PAUSE_MARGIN."""
    left = max(0.0, r.out_tokens - r.tokens)
    if left * r.tpot_s <= needed_by_s:
        return False
    return min(slack_s(r), r.max_pause_s) >= PAUSE_MARGIN * pause_s
