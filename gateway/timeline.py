"""The clock of every request's timeline (`now_ns`: monotonic ns), and the gaps between one
stream's successive token events, kept as histogram bucket counts — a hot-path structure of the
record, read by telemetry.

A stream's memory must not grow with its length: a list of token stamps took 40 bytes per token
(1.3 MB for a 32k-token reasoning answer; a hostile upstream streaming tiny events for the whole
total timeout could take gigabytes). Counting each gap into the inter-token-latency histogram's
own buckets keeps what the histogram needs, exactly, in a fixed few hundred bytes; the sum of
the gaps is the span from the first stamp to the last. The stamps are counted in batches of
BATCH (one tight loop: ~35 ns per token more than keeping them all).
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator

now_ns = time.monotonic_ns

BATCH = 256  # token stamps a stream holds before they are counted (~10 KB at most)


class Gaps:
    """Gap counts over `bounds_ns` (a histogram's upper bounds, ascending; the last bucket is
    +Inf) and their sum."""

    __slots__ = ("bounds_ns", "counts", "total_ns")

    def __init__(self, bounds_ns: tuple[int, ...]) -> None:
        self.bounds_ns = bounds_ns
        self.counts = [0] * (len(bounds_ns) + 1)
        self.total_ns = 0

    def take(self, stamps: list[int]) -> None:
        """Count the gaps between successive `stamps` (monotonic ns); all but the last stamp are
        removed (the next gap starts there)."""
        bounds, counts = self.bounds_ns, self.counts
        prev = stamps[0]
        for t in stamps[1:]:
            counts[bisect_left(bounds, t - prev)] += 1  # le: a gap equal to a bound is in it
            prev = t
        self.total_ns += prev - stamps[0]
        del stamps[:-1]

    def __len__(self) -> int:
        return sum(self.counts)

    def total_s(self) -> float:
        return self.total_ns / 1e9

    def midpoints_s(self) -> Iterator[tuple[float, int]]:
        """(middle of the bucket in seconds, number of gaps in it) per bucket that has any, for
        a histogram with other buckets (OTLP): exact counts per value range, a sum within the
        buckets' widths. The +Inf bucket's gaps are put just over the last bound."""
        bounds = self.bounds_ns
        for i, n in enumerate(self.counts):
            if n:
                low = bounds[i - 1] if i else 0
                yield ((low + bounds[i]) / 2e9 if i < len(bounds) else (low + 1) / 1e9), n
