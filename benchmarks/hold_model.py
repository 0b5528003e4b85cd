"""A loss model of slot holds: a light class with a tight TTFT target beside a flood, on a
non-preemptive engine of N slots, under hold policies the gateway could run.

    python -m benchmarks.hold_model [--slots 8] [--rate 1.62] [--hold-s 2.0] [--slack-s 0.18]

The light class's requests arrive as a Poisson process at `--rate`; every request (light or
flood) holds its slot for an exponential time of mean `--hold-s` (the simulator's answers run
25-400 tokens, and its slot releases come ~exponentially spaced). The flood always has a
request ready and takes any free slot beyond those held. A light request that finds a slot
free takes it; one that finds none waits `--slack-s` (its TTFT target less its prefill) for
the next release, which is its, and is lost otherwise. A policy (M, K, F) keeps
max(F, min(M - n, K)) slots free for the light class while it has n in flight: protected up
to M in flight, at most K held at once, at least F held whatever it has in flight.

Prints, per policy, the light class's share of its arrivals served and the slots busy (an
upper bound on the total goodput as a fraction of the engine's). The gateway ships (round
share, 3, 0): the deficit below the class's fair share, up to three. Against the fairness
matrix's flood cell (1.62 req/s, share ~3.3 slots) the model and the gateway agree on that
policy (model 73 % served at 90 % busy; the gateway 59-69 % at a total of 87-92 % in four
runs), but not on the two others tried in the gateway: (8, 1, 1) measured 58 % at 97 % (one
run) where the model says 82 % at 92 %, and (3, 3, 1) 64 % and 59 % (at 93 and 89 %) where it
says 86 % at 88 %. The gap is what the model leaves out: the start prediction that refuses a
request whose turn it judges too late (the model's requests always wait their slack), the
class's demand lapsing after 2 s without an arrival (the flood then takes every slot), a
hold's expiry after two of the class's mean gaps.
A model, not a measurement: use it to pick which policy to measure."""
from __future__ import annotations

import argparse
import heapq
import random
from dataclasses import dataclass

POLICIES = ((3, 3, 0), (4, 3, 0), (3, 3, 1), (3, 2, 1), (4, 2, 1), (8, 1, 1), (8, 2, 2))


@dataclass(frozen=True)
class Outcome:
    served: float  # of the light class's arrivals
    busy: float  # mean fraction of the slots in use


def simulate(protect: int, most: int, least: int, *, slots: int, rate: float, hold_s: float,
             slack_s: float, duration_s: float, seed: int) -> Outcome:
    rnd = random.Random(seed)
    ends: list[tuple[float, bool]] = []  # (when a slot frees, whether the light class held it)
    waiting: list[float] = []  # the deadlines of light requests waiting for a release
    light = flood = served = lost = 0
    now = last = busy_area = 0.0
    next_arrival = rnd.expovariate(rate)

    def fill() -> None:
        nonlocal flood
        kept = max(least, min(protect - light, most))
        while slots - flood - light > kept:
            flood += 1
            heapq.heappush(ends, (now + rnd.expovariate(1.0 / hold_s), False))

    fill()
    while now < duration_s:
        t_end = ends[0][0] if ends else float("inf")
        t_wait = waiting[0] if waiting else float("inf")
        t = min(next_arrival, t_end, t_wait)
        busy_area += (flood + light) * (t - last)
        now = last = t
        if t == next_arrival:
            next_arrival = now + rnd.expovariate(rate)
            if slots - flood - light > 0:
                light += 1
                served += 1
                heapq.heappush(ends, (now + rnd.expovariate(1.0 / hold_s), True))
            else:
                heapq.heappush(waiting, now + slack_s)
        elif t == t_end:
            _, was_light = heapq.heappop(ends)
            if was_light:
                light -= 1
            else:
                flood -= 1
            if waiting:  # the release is the oldest waiter's
                heapq.heappop(waiting)
                light += 1
                served += 1
                heapq.heappush(ends, (now + rnd.expovariate(1.0 / hold_s), True))
        else:
            heapq.heappop(waiting)
            lost += 1
        fill()
    return Outcome(served / max(1, served + lost), busy_area / duration_s / slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rate", type=float, default=1.62, help="light class, requests/s")
    ap.add_argument("--hold-s", type=float, default=2.0, help="mean slot hold, s")
    ap.add_argument("--slack-s", type=float, default=0.18, help="how long a light request "
                    "can wait for a release")
    ap.add_argument("--duration-s", type=float, default=30_000.0, help="simulated time")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(f"{args.slots} slots, light class {args.rate:g} req/s x {args.hold_s:g} s "
          f"(~{args.rate * args.hold_s:.1f} slots), slack {args.slack_s * 1e3:.0f} ms\n")
    print("| protect up to M | hold at most K | hold at least F | light served | slots busy |")
    print("|---|---|---|---|---|")
    for m, k, f in POLICIES:
        out = simulate(m, k, f, slots=args.slots, rate=args.rate, hold_s=args.hold_s,
                       slack_s=args.slack_s, duration_s=args.duration_s, seed=args.seed)
        print(f"| {m} | {k} | {f} | {out.served:.0%} | {out.busy:.1%} |")


if __name__ == "__main__":
    main()
