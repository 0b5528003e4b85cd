"""An adaptive concurrency limit per replica: how many requests the engine can usefully run at
once, learned from the upstream TTFT of the gateway's own requests.

Fairness and priority only work while requests wait where they can be ordered: in the
gateway's queue, not in the engine's. A continuous-batching engine that is handed more than
its batch parks the surplus in its own FIFO, where a request waits for a running one to finish
(seconds) instead of one decode step (milliseconds), so the TTFT of the surplus jumps by an
order of magnitude. That jump is the signal, as in Envoy's adaptive_concurrency filter
(gradient = minRTT / sampleRTT) and Netflix concurrency-limits (Gradient2, AIMD):

- each finished request gives one sample: its upstream TTFT less its own prefill estimate (so
  long prompts are not mistaken for queueing);
- the baseline is the median of the last `window` samples; a sample is *slow* when it exceeds
  `tolerance` x baseline and baseline + `floor_s` (jitter on a fast engine is not queueing);
- additive increase: +1 / limit per sample that is not slow, only while the limit binds (at
  least 80 % of it in use: an idle replica teaches nothing about its capacity);
- multiplicative decrease: x `backoff` on a slow sample, at most once per `limit` samples (one
  round trip's worth), never below `min_limit`;
- `max_limit` (`[admission] max_concurrency`, or the backend's own) is the upper bound; an
  engine that publishes its batch size (`max_num_seqs`) through scraped metrics caps it too.

Pure: the controller feeds samples; tests drive it without an engine.
"""
from __future__ import annotations

from collections import deque
from typing import Any

WINDOW = 64
FLOOR_S = 0.05
BACKOFF = 0.85


class AdaptiveLimit:
    __slots__ = ("limit", "min_limit", "max_limit", "tolerance", "samples", "since_cut",
                 "cuts", "engine_cap", "floor_s")

    def __init__(self, initial: int, min_limit: int, max_limit: int, tolerance: float = 2.0,
                 floor_s: float = FLOOR_S) -> None:
        self.max_limit = max(1, max_limit)
        self.min_limit = max(1, min(min_limit, self.max_limit))
        self.limit = float(min(max(initial, self.min_limit), self.max_limit))
        self.tolerance = tolerance
        self.floor_s = floor_s
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self.since_cut = 0
        self.cuts = 0
        self.engine_cap: float | None = None

    @property
    def value(self) -> int:
        """The limit now (whole requests)."""
        cap = float(self.max_limit) if self.engine_cap is None else min(self.max_limit,
                                                                         self.engine_cap)
        return max(self.min_limit, int(min(self.limit, cap)))

    def baseline(self) -> float | None:
        if len(self.samples) < 8:
            return None
        ordered = sorted(self.samples)
        return ordered[len(ordered) // 2]

    def sample(self, queueing_s: float, in_flight: int) -> None:
        """One finished request's upstream TTFT beyond its own prefill, with `in_flight`
        requests on the replica when it was sent."""
        base = self.baseline()
        self.samples.append(max(0.0, queueing_s))
        self.since_cut += 1
        slow = base is not None and queueing_s > max(self.tolerance * base,
                                                     base + self.floor_s)
        if slow:
            if self.since_cut >= self.limit:
                self.limit = max(float(self.min_limit), self.limit * BACKOFF)
                self.since_cut = 0
                self.cuts += 1
        elif in_flight >= 0.8 * self.value:
            self.limit = min(float(self.max_limit), self.limit + 1.0 / max(1.0, self.limit))

    def engine_reports(self, max_running: float | None) -> None:
        """The engine's own batch size, when its metrics publish one."""
        self.engine_cap = max_running if max_running and max_running > 0 else None

    def snapshot(self) -> dict[str, Any]:
        base = self.baseline()
        return {"limit": self.value, "max": self.max_limit, "min": self.min_limit,
                "baseline_s": round(base, 5) if base is not None else None,
                "decreases": self.cuts, "engine_cap": self.engine_cap}
