"""When a queued request will start: its place in the fair order and the slots that free
before its turn.

A replica runs at most `limit` of this gateway's requests at once; a waiter starts when a slot
frees and every waiter ahead of it in the fair order (admission/fairness.py) has taken one. So
its predicted start is the time of the k-th slot release, k its position in that order, where
the releases are those of the streams in flight (each frees its slot when its predicted
remaining decode is done) and then those of the waiters ahead that took a slot (each holds it
for its own predicted TTFT plus output tokens x TPOT). Work queued behind it, or ahead of it in
the queue but not in the order, does not delay it: a flow under its fair share is placed near
the head, and its wait is the time to the next free slot, not the whole queue's.

Pure: times are seconds from now; the controller turns its state into `Slots`.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.admission.estimator import ReplicaEstimator


@dataclass(frozen=True, slots=True)
class Slots:
    """One replica's slots as admission sees them now."""
    free: int  # slots free now (its limit minus the requests in flight)
    releases: Sequence[float]  # seconds until each busy slot frees
    first_token_s: float  # a request started there: its predicted time to first token
    tpot_s: float  # ... and to each further token, with the replica at its limit


def remaining_s(elapsed_s: float, predicted_ttft_s: float, output_tokens: float,
                tpot_s: float) -> float:
    """An in-flight stream's predicted time until its slot frees: its predicted first token
    plus its output tokens' decode, less what it has run. A stream that runs longer than
    predicted still holds its slot: at least one more token."""
    return max(tpot_s, predicted_ttft_s + max(0.0, output_tokens - 1) * tpot_s - elapsed_s)


def minimal_ttft_s(est: ReplicaEstimator, prompt_tokens: float) -> float:
    """The TTFT no load level beats on a replica: its prompt prefilled on an idle engine, plus
    one decode step. A TTFT target tighter than this is physically out of reach."""
    return est.predict_ttft(prompt_tokens, 0.0, 0.0) + est.predict_tpot(1.0)


class SlotPlan:
    """The slots of one model's replicas, handed out in order: each `take` is the next waiter
    in fair order, started at the earliest slot to free, which it then holds for its own
    TTFT and decode. Starts come out non-decreasing."""

    __slots__ = ("_heap", "_slots", "_recent", "_recent_tokens")

    def __init__(self, slots: Sequence[Slots]) -> None:
        self._slots = list(slots)
        self._heap: list[tuple[float, int]] = []
        for i, s in enumerate(self._slots):
            self._heap.extend((0.0, i) for _ in range(max(0, s.free)))
            self._heap.extend((max(0.0, t), i) for t in s.releases)
        heapq.heapify(self._heap)
        # waiters already planned, (start, prompt tokens): those that start together prefill
        # together
        self._recent: deque[tuple[float, float]] = deque()
        self._recent_tokens = 0.0

    def peek(self) -> float:
        """When the next slot frees (inf when the model has none)."""
        return self._heap[0][0] if self._heap else math.inf

    def take(self, output_tokens: float, prompt_tokens: float = 0.0) -> float:
        """The next waiter in order takes the earliest slot: its start, in seconds from now."""
        if not self._heap:
            return math.inf
        start, i = heapq.heappop(self._heap)
        s = self._slots[i]
        heapq.heappush(self._heap, (start + s.first_token_s
                                    + max(0.0, output_tokens - 1) * s.tpot_s, i))
        self._recent.append((start, prompt_tokens))
        self._recent_tokens += prompt_tokens
        return start

    def prefilling_with(self, start: float, within_s: float) -> float:
        """Prompt tokens of the waiters planned so far that start within `within_s` before
        `start` (the last one taken included): they prefill beside it."""
        while self._recent and self._recent[0][0] < start - within_s:
            self._recent_tokens -= self._recent.popleft()[1]
        return max(0.0, self._recent_tokens)
