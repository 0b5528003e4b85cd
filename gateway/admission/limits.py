"""An adaptive concurrency limit per replica: how many requests the engine can usefully run at
once, learned from the upstream TTFT of the gateway's own requests.

Fairness and priority only work while requests wait where they can be ordered: in the
gateway's queue, not in the engine's. A continuous-batching engine that is handed more than
its batch parks the surplus in its own FIFO, where a request waits for a running one to finish
(seconds) instead of one decode step (milliseconds), so the TTFT of the surplus jumps by an
order of magnitude. That jump is the signal, as in Envoy's adaptive_concurrency filter
(gradient = minRTT / sampleRTT) and Netflix concurrency-limits (Gradient2, AIMD):

- each request gives one sample at its first token: its TTFT since dispatch less its own
  prefill estimate (so long prompts are not mistaken for queueing); at the first token, not at
  the end, so the limit hears about engine queueing one TTFT later, not one whole answer later;
- the baseline is the 10th percentile of the last WINDOW samples (the unqueued ones: it does
  not drift up while a surplus queues); a sample is *slow* when it exceeds both `tolerance` x
  the lower quartile and baseline + `floor_s` (prefill interleaving and jitter are not
  queueing; a request parked behind a full batch waits for a running one to finish). The
  quartile, not the median: slow start overshooting a batch of 8 by 4 queues a third of the
  first samples, which would lift a median to their level and pass them all as normal;
- a slow sample sent with N requests on the replica brings the limit down to N - 1 at once
  (the engine queued it: its batch is below N);
- samples are judged in rounds of `limit` samples (one round trip's worth). Multiplicative
  decrease: x BACKOFF after a round where more than SLOW_SHARE of the samples were slow (a
  surplus parked in the engine; a rare outlier is not one; a probe's, below, and slow start's
  do not count: coming down to the level below them answered them), never below `min_limit`
  nor below the level served unqueued since the last slow sample (each slow sample has
  already brought the limit below its own level). Increase,
  only while the limit binds (at least 80 % of it in use: an idle replica teaches nothing about
  its capacity) and while the round has seen no slow sample: +1 per sample until the first
  decrease (slow start, as TCP), then +1 every two rounds (probing slowly above a limit that
  has once been too high keeps the engine's queue short);
- `max_limit` (`[admission] max_concurrency`, or the backend's own) is the upper bound; an
  engine that publishes its batch size (`max_num_seqs`) through scraped metrics caps it too.

Once the limit has come down, it knows a level the engine serves without queueing: `proven`,
the most requests in flight at a dispatch whose first token did not wait in the engine since
the last slow one (after the first cut, PROOF such samples above it in a row raise it one
step: the gateway's count of its requests in flight is not the engine's occupancy — a stream
the engine has finished may still be relaying — so one unqueued sample at a level is luck,
not proof; and a sample counts as unqueued only within CLEAN x the floor of the baseline:
above the batch a request waits in the engine until a running stream ends, often for less
than the floor, which is not slow but no proof either, and ends the row).
A dispatch above it is a *probe*: it may wait in the engine's queue for a running stream to
end. The controller predicts that wait for it (a tight class then waits in the gateway's
queue instead, where the fair order applies) and does not teach the TTFT estimator a probe's
queueing as the engine's speed.

Pure: the controller feeds samples; tests drive it without an engine.
"""
from __future__ import annotations

from collections import deque
from typing import Any

WINDOW = 256
MIN_SAMPLES = 3  # before this many, nothing is judged slow (the 10th percentile is their least)
FLOOR_S = 0.25
BACKOFF = 0.85
SLOW_SHARE = 0.1
PROOF = 3  # unqueued samples above the proven level (since the last slow one) that raise it one
# ... unqueued: within this share of the floor of the 10th percentile. Above the batch a request
# waits in the engine until a running stream ends, often less than the floor: not slow, but
# no proof either
CLEAN = 0.2


class AdaptiveLimit:
    __slots__ = ("limit", "min_limit", "max_limit", "tolerance", "samples", "round_n",
                 "round_slow", "cuts", "engine_cap", "floor_s", "proven", "_proof", "_base",
                 "_quartile", "_base_age")

    def __init__(self, initial: int, min_limit: int, max_limit: int, tolerance: float = 2.0,
                 floor_s: float = FLOOR_S) -> None:
        self.max_limit = max(1, max_limit)
        self.min_limit = max(1, min(min_limit, self.max_limit))
        self.limit = float(min(max(initial, self.min_limit), self.max_limit))
        self.tolerance = tolerance
        self.floor_s = floor_s
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self.round_n = 0
        self.round_slow = 0
        self.cuts = 0
        self._base: float | None = None
        self._quartile = 0.0
        self._base_age = 0
        self.engine_cap: float | None = None
        self.proven = 0  # requests in flight the engine served unqueued (since the last slow)
        self._proof = 0  # unqueued samples above it since

    @property
    def value(self) -> int:
        """The limit now (whole requests)."""
        cap = float(self.max_limit) if self.engine_cap is None else min(self.max_limit,
                                                                         self.engine_cap)
        return max(self.min_limit, int(min(self.limit, cap)))

    def baseline(self) -> float | None:
        """The 10th percentile of recent samples (recomputed every 16 samples; while there are
        fewer than 16, at every sample, so that slow start's first overshoot is judged)."""
        if len(self.samples) < MIN_SAMPLES:
            return None
        if self._base is None or self._base_age >= 16 or len(self.samples) < 16:
            ordered = sorted(self.samples)
            self._base = ordered[len(ordered) // 10]
            self._quartile = ordered[len(ordered) // 4]
            self._base_age = 0
        return self._base

    def sample(self, queueing_s: float, in_flight: int) -> bool:
        """One finished request's upstream TTFT beyond its own prefill, with `in_flight`
        requests on the replica when it was sent. True: it was slow (queued in the engine)."""
        base = self.baseline()
        self.samples.append(max(0.0, queueing_s))
        self._base_age += 1
        slow = base is not None and queueing_s > max(self.tolerance * self._quartile,
                                                     base + self.floor_s)
        self.round_n += 1
        if slow:
            # A probe that queued is answered by coming down to the level below it (next);
            # only slow samples at levels the engine had served count towards a backoff
            # (counting the probe too took the limit below the batch after every probe).
            if self.cuts and not self.probe(in_flight):
                self.round_slow += 1
            self.proven = min(self.proven, in_flight - 1)
            self._proof = 0
            # It was sent with `in_flight` on the replica and still queued in the engine: the
            # engine's batch is below that. Come down to it now (and end slow start), rather
            # than a round of samples later.
            if in_flight > self.min_limit and in_flight - 1 < self.limit:
                self.limit = float(in_flight - 1)
                self.cuts = max(self.cuts, 1)
        else:
            if not self.cuts:
                # slow start: a level served unqueued; one whose first token waited for a
                # stream to end (not slow) is not (it set 9 on a batch-8 engine, whose 9th
                # slot then took tight requests that waited there)
                if self.unqueued(queueing_s):
                    self.proven = max(self.proven, in_flight)
            elif in_flight > self.proven:
                if self.unqueued(queueing_s):
                    self._proof += 1
                    if self._proof >= PROOF:
                        self.proven, self._proof = self.proven + 1, 0
                else:
                    # It waited, if less than a slow sample's margin: the level queues, and
                    # the unqueued samples before it were streams ending just in time (one
                    # probe in six above a batch-8 engine: three of them, not in a row,
                    # proved a 9th slot, and tight requests sent into it waited there)
                    self._proof = 0
            if in_flight >= 0.8 * self.value and not self.round_slow:
                step = 1.0 if not self.cuts else 0.5 / max(1.0, self.limit)
                self.limit = min(float(self.max_limit), self.limit + step)
        if self.round_n >= max(4.0, self.limit):
            if self.round_slow > SLOW_SHARE * self.round_n:
                # never below the level served unqueued since the last slow sample: each
                # slow one has already brought the limit (and that level) below its own
                self.limit = max(float(self.min_limit), float(self.proven),
                                 self.limit * BACKOFF)
                self.cuts += 1
            self.round_n = self.round_slow = 0
        return slow

    def unqueued(self, queueing_s: float) -> bool:
        """Was a first token this far beyond its own prefill served without waiting in the
        engine's queue (within CLEAN x the floor of the baseline)? Only such a sample proves
        a level, and only such a probe may teach the TTFT estimator: above the batch a request
        waits for a running stream to end, often for less than a slow sample's margin, and
        taught, that wait pads every request of its tenant."""
        return queueing_s <= max(self.tolerance * self._quartile,
                                 (self._base or 0.0) + CLEAN * self.floor_s)

    def probe(self, in_flight: int) -> bool:
        """Would a dispatch with `in_flight` requests on the replica (itself included) be
        above the level the engine has served unqueued? Only once the limit has come down:
        before, slow start probes with every dispatch and nothing is known yet."""
        return self.cuts > 0 and in_flight > max(self.proven, self.min_limit)

    def engine_reports(self, max_running: float | None) -> None:
        """The engine's own batch size, when its metrics publish one."""
        self.engine_cap = max_running if max_running and max_running > 0 else None

    def snapshot(self) -> dict[str, Any]:
        base = self.baseline()
        return {"limit": self.value, "max": self.max_limit, "min": self.min_limit,
                "baseline_s": round(base, 5) if base is not None else None,
                "decreases": self.cuts, "engine_cap": self.engine_cap,
                "proven": self.proven}
