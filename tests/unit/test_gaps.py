"""A stream's inter-token gaps are counted in batches (gateway/timeline.py): the ITL
histogram gets exactly what one observation per gap gave, and a stream's memory does not grow
with its length."""
from __future__ import annotations

import itertools
import tracemalloc
from bisect import bisect_left

from hypothesis import given, settings, strategies as st

from gateway.apis.base import NOTHING, VISIBLE_TOKEN
from gateway.apis.chat import CHAT
from gateway.exchange import Exchange
from gateway.telemetry.prometheus import Histogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)


def one_per_gap(stamps: list[int]) -> tuple[list[int], float]:
    """What the histogram held when every gap was observed on its own."""
    h = Histogram("itl", "", ("backend",), BUCKETS)
    for a, b in itertools.pairwise(stamps):
        h.observe(("b",), (b - a) / 1e9)
    counts, total, _ = h._get(("b",))
    return counts, total


def stream(ex: Exchange, stamps: list[int], other_events: int = 0) -> None:
    for t in stamps:
        for _ in range(other_events):
            ex.event_seen(NOTHING, t)
        ex.event_seen(VISIBLE_TOKEN, t)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2_000_000_000), max_size=600),
       st.integers(min_value=0, max_value=2))
def test_the_itl_histogram_gets_what_one_observation_per_gap_gave(
        steps: list[int], other_events: int) -> None:
    stamps = list(itertools.accumulate(steps, initial=1_000))
    # gaps on the bounds themselves (le: a gap equal to a bound is in that bucket)
    stamps += [stamps[-1] + int(b * 1e9) for b in BUCKETS[:3]]
    h = Histogram("itl", "", ("backend",), BUCKETS)
    ex = Exchange(CHAT, h.bounds_ns)
    stream(ex, stamps, other_events)
    gaps = ex.counted_gaps()
    assert gaps is not None and len(gaps) == len(stamps) - 1
    h.observe_gaps(("b",), gaps)
    counts, total, _ = h._get(("b",))
    want_counts, want_total = one_per_gap(stamps)
    assert counts == want_counts
    assert abs(total - want_total) < 1e-6


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=2_000_000_000), min_size=1, max_size=60))
def test_gaps_counted_over_other_bounds_keep_their_count_and_sum(steps: list[int]) -> None:
    """Gaps counted over other bounds (an exchange made without the histogram's, or OTLP's
    buckets): every gap is still counted once, at a value inside the bucket it was counted in,
    and the sum is exact."""
    stamps = list(itertools.accumulate(steps, initial=1_000))
    bounds = (int(0.01e9), int(0.1e9))
    ex = Exchange(CHAT, bounds)
    stream(ex, stamps)
    gaps = ex.counted_gaps()
    assert gaps is not None
    for value, n in gaps.midpoints_s():
        inside = [g for g in steps if bisect_left(bounds, g) == bisect_left(bounds, value * 1e9)]
        assert len(inside) == n
    h = Histogram("itl", "", ("backend",), BUCKETS)
    h.observe_gaps(("b",), gaps)
    counts, total, _ = h._get(("b",))
    assert sum(counts) == len(steps)
    assert abs(total - sum(steps) / 1e9) < 1e-6


def test_a_failed_attempt_takes_its_gaps_with_it() -> None:
    """Gaps are those of the attempt that answered (as the timeline's stamps are)."""
    ex = Exchange(CHAT, Histogram("itl", "", ("backend",), BUCKETS).bounds_ns)
    stream(ex, [1_000 + i * 1_000_000 for i in range(600)])  # counted in batches
    ex.attempt_failed("upstream_error", None)
    assert ex.counted_gaps() is None
    stream(ex, [900_000_000, 901_000_000, 903_000_000])
    gaps = ex.counted_gaps()
    assert gaps is not None and len(gaps) == 2


def test_a_streams_memory_does_not_grow_with_its_tokens() -> None:
    """200,000 token events (a hostile upstream's flood, or hours of an agent's stream): the
    exchange's gap bookkeeping stays bounded (a list of every stamp was 40 B/token: 8 MB)."""
    ex = Exchange(CHAT, Histogram("itl", "", ("backend",), BUCKETS).bounds_ns)
    stream(ex, [1_000 + i * 1_000_000 for i in range(100)])  # allocated, warmed up
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        t = ex.t_last_token
        for i in range(200_000):
            t += 1_000_000 + i % 7
            ex.event_seen(VISIBLE_TOKEN, t)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    gaps = ex.counted_gaps()
    assert gaps is not None and len(gaps) == 200_099
    assert grown < 16 * 1024, grown
