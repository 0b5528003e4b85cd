"""Slots held for a class under its fair share of a model's slots.

A class with a tight TTFT target cannot wait for a slot to free: a slot frees every
hold / limit seconds, often longer than its budget. So without a reservation a looser class
that can wait takes every slot that frees, and the tight one is refused for a TTFT the engine
could meet. Each class with demand is entitled to its weighted max-min fair share of the
model's slots (water-filling: a class whose arrival rate x slot hold time needs fewer slots
gets what it needs, the rest is split by weight). A request of a class at or over its
entitlement may not take a slot that would leave fewer free slots than the deficits
(entitlement less slots in flight) of the classes under theirs whose TTFT target is as tight
as its own or tighter, up to MAX_HELD: those slots wait for them. A class under its own share
leaves them to the classes under theirs with a strictly tighter target (with three classes,
the middle one, under its share too, took the slots the tightest needed on arrival, and
could have waited for the next). Between classes of the same
target too: the fair order puts the one under its share first, but its turn comes when the
next slot frees, and a tight target often cannot wait that long (one flooding class took every
slot that freed, the other was refused). More than one slot is held because a tight class's
arrivals come in bursts and each needs a slot free when it comes: with one held, a class
weighted 3:1 at 4x the unloaded TTFT got 65 % of its share, with three 80 % (total goodput
91 % of the peak: the held slots' idle time is the price).
The reservation ends when the class's demand stops (no arrival for `ACTIVE_S`), and it
shrinks with the class's arrival rate, so a class that asks for little holds little; a class
none of whose requests was admitted, or refused for want of a slot, for `ACTIVE_S` (they are
refused for something a slot does not cure) holds none; and free slots that no request took
for two of its mean gaps between arrivals (the class was refused for something else, or its
demand paused) are anyone's again, so a reservation cannot idle the engine for long.

Pure: the controller passes the clock's time and the counts.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

ACTIVE_S = 2.0  # a class that had an arrival this recently has demand
RATE_TAU_S = 5.0  # the arrival rate's memory
# a rate is not measured over less than this: one arrival after a pause reads as one per
# ACTIVE_S (about 0.6 /s), not as the start of a flood
MIN_SEEN_S = ACTIVE_S
MAX_HELD = 3  # at most this many free slots wait: each one idles the engine until taken
HOLD_GAPS = 2.0  # free slots wait this many of the held-for classes' gaps between arrivals


@dataclass(slots=True)
class Demand:
    """One SLO class's recent arrivals."""
    last_s: float  # its last arrival (controller clock, s)
    weight: float
    ttft_s: float  # its TTFT target
    rate: float = 0.0  # arrivals per second, exponentially decayed, as of last_s
    first_s: float = -math.inf  # when its arrivals began (the decayed rate is debiased)
    # its last request admitted, or refused because its turn at a slot came too late: slots
    # held for it are of use (one refused with a slot free for it would not have used one)
    used_s: float = -math.inf

    def arrive(self, now_s: float, weight: float, ttft_s: float) -> None:
        if now_s - self.last_s > RATE_TAU_S:  # idle that long: measured afresh (the
            # controller starts a class's demand so too, at its first arrival)
            self.rate, self.first_s = 0.0, now_s
        self.rate = self._decayed(now_s) + 1.0 / RATE_TAU_S
        self.last_s, self.weight, self.ttft_s = now_s, weight, ttft_s

    def _decayed(self, now_s: float) -> float:
        return self.rate * math.exp(-max(0.0, now_s - self.last_s) / RATE_TAU_S)

    def rate_at(self, now_s: float) -> float:
        """Arrivals per second. The decayed sum of a demand that began less than RATE_TAU_S
        ago holds only part of a window: divided by that part, so a class that starts is
        entitled to its share within MIN_SEEN_S, not after RATE_TAU_S (the flooding class
        took every slot meanwhile)."""
        seen = max(MIN_SEEN_S, now_s - self.first_s)
        return self._decayed(now_s) / -math.expm1(-seen / RATE_TAU_S)


def fair_shares(demand: Mapping[str, float], weight: Mapping[str, float],
                capacity: float) -> dict[str, float]:
    """Weighted max-min fair shares of `capacity` (water-filling): a class asking less than
    its weighted part gets what it asks, the rest is split by weight among the others."""
    share = {c: 0.0 for c in demand}
    active = {c for c, d in demand.items() if d > 0}
    left = capacity
    while active and left > 1e-9:
        total_w = sum(weight[c] for c in active)
        sated = {c for c in active if demand[c] - share[c] <= left * weight[c] / total_w}
        if not sated:
            for c in active:
                share[c] += left * weight[c] / total_w
            break
        for c in sated:
            left -= demand[c] - share[c]
            share[c] = demand[c]
        active -= sated
    return share


def slot_shares(demands: Mapping[str, Demand], limit: int, hold_s: float,
                now_s: float) -> dict[str, float]:
    """Each class with demand: its weighted max-min fair share of `limit` slots, the slots it
    needs being its arrival rate x `hold_s` (how long a request holds its slot; Little's
    law)."""
    active = {c: d for c, d in demands.items()
              if now_s - d.last_s < ACTIVE_S and now_s - d.used_s < ACTIVE_S}
    if hold_s <= 0.0:
        return {}
    return fair_shares({c: d.rate_at(now_s) * hold_s for c, d in active.items()},
                       {c: d.weight for c, d in active.items()}, float(limit))


def under_share(cls: str, share: Mapping[str, float], in_flight: Mapping[str, int]) -> bool:
    """Does `cls` have demand and fewer slots in flight than its share (by half a slot)?"""
    return cls in share and in_flight.get(cls, 0) < share[cls] - 0.5


def holds_for(taker_ttft_s: float, taker_under: bool, other_ttft_s: float) -> bool:
    """Does a request of a class with `taker_ttft_s` (under its share or not) leave free slots
    to a class of `other_ttft_s` under its share? For a tighter one always, for one of its own
    target only while it is itself at or over its share."""
    return other_ttft_s < taker_ttft_s or (other_ttft_s == taker_ttft_s and not taker_under)


def reserved_slots(taker: str, demands: Mapping[str, Demand], share: Mapping[str, float],
                   in_flight: Mapping[str, int], now_s: float) -> tuple[int, float]:
    """Free slots a request of class `taker` must leave: the deficits of the classes under
    their `share` whose TTFT target is as tight as the taker's or tighter (strictly tighter
    while the taker is itself under its share: the looser of two classes both short of their
    share can wait for the next slot, the tighter cannot), and how long those slots may wait
    for them: HOLD_GAPS of their mean gap between arrivals, at most ACTIVE_S. A slot held
    that long was not needed."""
    under = under_share(taker, share, in_flight)
    own = demands[taker].ttft_s if taker in demands else math.inf
    deficit = rate = 0.0
    for c, s in share.items():
        if c != taker and holds_for(own, under, demands[c].ttft_s) \
                and s > in_flight.get(c, 0):
            deficit += s - in_flight.get(c, 0)
            rate += demands[c].rate_at(now_s)
    slots = min(MAX_HELD, math.floor(deficit + 0.5))
    return slots, min(ACTIVE_S, HOLD_GAPS / rate) if slots and rate > 0 else 0.0
