"""The console's recorder: a bounded, sampled window of finished requests.

Fed once per request from `Finisher.finish` (`record(ctx)`), reading only attributes of the
finished request; everything else happens when a browser asks (`snapshot()`, at most a few
times a second). Memory is bounded whatever the rate:

* per SLO class, one time slot per `slot_s` over `window_s`, each with request counts and two
  log-spaced histograms (TTFT, TPOT: ~4 % relative error on a percentile), so P50 / P99 cost
  one array increment per request and the charts one small scan per snapshot;
* the slowest requests: per slot, a heap of the `slow_keep` longest (its stages are built only
  for a request that makes it in), merged over the last `slow_window_s`;
* recent requests: a ring of `recent_size` rows, sampled to about `recent_per_s` a second
  when the gateway serves more than that.

At 1,000 requests/s that is a few hundred KiB, and `record` costs a few microseconds per
request (2.7 µs measured on a shared 2-core CI machine); a snapshot ~10 ms, at most twice a
second whatever the number of open tabs.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.exchange import Exchange

# The goodput objective the shipped alert rules use (slogate:slo_objective:ratio).
OBJECTIVE = 0.99

# Log-spaced histogram bins over milliseconds: bin i holds values in [G^(i-1), G^i) * BASE_MS.
_GROWTH = 1.08
_LOG_G = math.log(_GROWTH)
_BASE_MS = 0.1
_BINS = int(math.log(3_600_000 / _BASE_MS) / _LOG_G) + 2  # up to an hour

# Waterfall stages, in the order they happen (the page shows them in this order and colour).
STAGES = ("gateway_queue", "connect", "engine_queue", "prefill", "first_token", "decode")

UNCLASSIFIED = "none"  # a request refused before it had an SLO class


def _bin(ms: float) -> int:
    if ms <= _BASE_MS:
        return 0
    return min(_BINS - 1, int(math.log(ms / _BASE_MS) / _LOG_G) + 1)


def _bin_value(i: int) -> float:
    """A representative value of bin i (geometric middle of its bounds)."""
    if i == 0:
        return _BASE_MS
    return float(_BASE_MS * _GROWTH ** (i - 0.5))


def percentiles(hist: list[int], n: int, qs: Iterable[float]) -> list[float | None]:
    """The q-quantiles of a histogram holding n values (None when empty)."""
    qs = list(qs)
    if n <= 0:
        return [None] * len(qs)
    ranks = [max(1, math.ceil(q * n)) for q in qs]
    out: list[float | None] = [None] * len(qs)
    seen = 0
    k = 0
    order = sorted(range(len(qs)), key=lambda j: ranks[j])
    for i, c in enumerate(hist):
        if not c:
            continue
        seen += c
        while k < len(order) and seen >= ranks[order[k]]:
            out[order[k]] = round(_bin_value(i), 2)
            k += 1
        if k == len(order):
            break
    return out


class _Slot:
    """One time slot of one SLO class."""

    __slots__ = ("epoch", "n", "judged", "met", "failed", "ttft", "ttft_n", "tpot", "tpot_n")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.n = self.judged = self.met = self.failed = 0
        self.ttft = [0] * _BINS
        self.tpot = [0] * _BINS
        self.ttft_n = self.tpot_n = 0


def stages(ctx: Any) -> list[dict[str, Any]]:
    """The request's stages on its own timeline (ms from arrival), measured by the gateway
    unless `source` says the provider reported it. Stages the provider did not report are not
    invented: without its queue and prefill times, the whole wait for the first token is
    `first_token`."""
    t0 = ctx.t_received

    def ms(a: int, b: int) -> float:
        return (b - a) / 1e6

    out: list[dict[str, Any]] = []

    def add(stage: str, start: float, dur: float, source: str = "gateway") -> None:
        if dur > 0:
            out.append({"stage": stage, "start_ms": round(start, 3), "ms": round(dur, 3),
                        "source": source})

    sent = ctx.t_sent
    dispatched = ctx.t_dispatched or sent
    if dispatched:
        add("gateway_queue", 0.0, ms(t0, dispatched))
    if not sent:
        if ctx.t_end:  # refused or cancelled before any upstream work
            add("gateway_queue", 0.0, ms(t0, ctx.t_end))
        return out
    upstream_start = ms(t0, sent)
    if dispatched and sent > dispatched:  # earlier attempts that failed before commit
        add("retries", ms(t0, dispatched), ms(dispatched, sent))
    cursor = upstream_start
    if ctx.t_connect_start and ctx.t_connect_end and ctx.t_connect_end >= sent:
        add("connect", ms(t0, ctx.t_connect_start), ms(ctx.t_connect_start, ctx.t_connect_end))
        cursor = ms(t0, ctx.t_connect_end)
    elif ctx.t_connect_start >= sent and not ctx.t_connect_end and ctx.t_end:
        add("connect", ms(t0, ctx.t_connect_start), ms(ctx.t_connect_start, ctx.t_end))
        return out  # the connection never opened
    first = ctx.t_first_token
    end_of_wait = ms(t0, first) if first else (ms(t0, ctx.t_end) if ctx.t_end else cursor)
    room = max(0.0, end_of_wait - cursor)
    for stage, seconds in (("engine_queue", ctx.provider_queue_s),
                           ("prefill", ctx.provider_prefill_s)):
        if seconds is not None and seconds > 0 and room > 0:
            dur = min(seconds * 1e3, room)
            add(stage, cursor, dur, "provider")
            cursor += dur
            room -= dur
    add("first_token", cursor, end_of_wait - cursor)
    if first and ctx.t_last_token and ctx.t_last_token > first:
        add("decode", ms(t0, first), ms(first, ctx.t_last_token))
    return out


class ConsoleRecorder:
    def __init__(self, classes: Iterable[Any] = (), *, slot_s: float = 5.0,
                 window_s: float = 300.0, slow_window_s: float = 60.0, slow_keep: int = 12,
                 recent_size: int = 200, recent_per_s: int = 50,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`classes`: the configured SLO classes (objects with name, ttft_ms, tpot_ms)."""
        self.targets: dict[str, dict[str, float]] = {}
        for c in classes:
            self.targets[c.name] = {"ttft_ms": c.ttft_ms, "tpot_ms": c.tpot_ms}
        self.slot_s = slot_s
        self.nslots = max(1, int(window_s / slot_s))
        self.slow_slots = max(1, int(slow_window_s / slot_s))
        self.slow_keep = slow_keep
        self.clock = clock
        self.started = clock()
        self.total = 0
        self._slots: dict[str, list[_Slot | None]] = {}
        self._slow: list[list[Any] | None] = [None] * self.nslots  # [epoch, heap]
        self._seq = itertools.count()
        self.recent: list[dict[str, Any] | None] = [None] * recent_size
        self._recent_i = 0
        self.recent_per_s = recent_per_s
        self._sec = -1
        self._sec_n = 0
        self._last_sec_n = 0
        self._rng = random.Random(0)

    # -- the hot path: once per finished request -----------------------------------------------
    def record(self, ctx: Exchange) -> None:
        now = self.clock()
        epoch = int(now / self.slot_s)
        self.total += 1
        slo = ctx.slo
        name = slo.name if slo is not None else UNCLASSIFIED
        ring = self._slots.get(name)
        if ring is None:
            if name not in self.targets and name != UNCLASSIFIED:
                name = "other"  # a class not configured (cannot happen today): bounded anyway
            ring = self._slots.setdefault(name, [None] * self.nslots)
        i = epoch % self.nslots
        slot = ring[i]
        if slot is None or slot.epoch != epoch:
            slot = ring[i] = _Slot(epoch)
        slot.n += 1
        verdict = ctx.verdict
        if verdict is not None:
            slot.judged += 1
            if verdict == "met":
                slot.met += 1
            elif verdict == "failed":
                slot.failed += 1
        t0 = ctx.t_received
        ttft_ms = tpot_ms = None
        if ctx.t_first_token:
            ttft_ms = (ctx.t_first_token - t0) / 1e6
            slot.ttft[_bin(ttft_ms)] += 1
            slot.ttft_n += 1
        n = ctx.completion_tokens
        if ctx.t_first_token and ctx.t_last_token and n and n > 1:
            tpot_ms = (ctx.t_last_token - ctx.t_first_token) / 1e6 / (n - 1)
            slot.tpot[_bin(tpot_ms)] += 1
            slot.tpot_n += 1
        e2e_ns = (ctx.t_end or ctx.t_received) - t0
        self._maybe_slow(ctx, epoch, e2e_ns, name, now)
        self._maybe_recent(ctx, now, name, ttft_ms, tpot_ms, e2e_ns)

    def _maybe_slow(self, ctx: Any, epoch: int, e2e_ns: int, cls: str, now: float) -> None:
        i = epoch % self.nslots
        entry = self._slow[i]
        if entry is None or entry[0] != epoch:
            entry = self._slow[i] = [epoch, []]
        heap = entry[1]
        if len(heap) >= self.slow_keep and e2e_ns <= heap[0][0]:
            return  # not among the slowest: nothing built
        row = self._row(ctx, cls, e2e_ns, now)
        row["stages"] = stages(ctx)
        item = (e2e_ns, next(self._seq), row)
        if len(heap) < self.slow_keep:
            heapq.heappush(heap, item)
        else:
            heapq.heapreplace(heap, item)

    def _maybe_recent(self, ctx: Any, now: float, cls: str, ttft_ms: float | None,
                      tpot_ms: float | None, e2e_ns: int) -> None:
        sec = int(now)
        if sec != self._sec:
            self._last_sec_n = self._sec_n if sec == self._sec + 1 else 0
            self._sec, self._sec_n = sec, 0
        self._sec_n += 1
        rate = max(self._last_sec_n, self._sec_n)
        if rate > self.recent_per_s and self._rng.random() * rate > self.recent_per_s:
            return  # sampled out
        row = self._row(ctx, cls, e2e_ns, now)
        row["ttft_ms"] = None if ttft_ms is None else round(ttft_ms, 2)
        row["tpot_ms"] = None if tpot_ms is None else round(tpot_ms, 2)
        self.recent[self._recent_i] = row
        self._recent_i = (self._recent_i + 1) % len(self.recent)

    @staticmethod
    def _row(ctx: Exchange, cls: str, e2e_ns: int, now: float) -> dict[str, Any]:
        trace = ctx.trace
        return {"request_id": ctx.request_id,
                "trace_id": trace.trace_id if trace is not None else None,
                "class": cls, "verdict": ctx.verdict, "outcome": ctx.outcome,
                "status": ctx.status, "backend": ctx.backend, "model": ctx.model_label,
                "route": ctx.route, "e2e_ms": round(e2e_ns / 1e6, 2), "at": now,
                "tenant": ctx.tenant, "hedge": ctx.hedge,
                "continued_from_token": list(ctx.continued_from)}

    # -- read side: a browser asks ------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        epoch = int(now / self.slot_s)
        first = epoch - self.nslots + 1
        # Charts start when the gateway did (at least a minute shown), not 5 empty minutes.
        chart_first = max(first, min(int(self.started / self.slot_s), epoch - 11))
        classes: dict[str, Any] = {}
        names = list(self.targets) + [n for n in self._slots if n not in self.targets]
        refused_unclassified = 0
        for name in names:
            live = [s for s in self._slots.get(name, ()) if s is not None and s.epoch >= first]
            if name == UNCLASSIFIED:  # refused before a class: a count, not a class of its own
                refused_unclassified = sum(s.n for s in live)
                continue
            live.sort(key=lambda s: s.epoch)
            classes[name] = self._class_view(name, live, chart_first, epoch)
        slow: list[tuple[int, int, dict[str, Any]]] = []
        for entry in self._slow:
            if entry is not None and entry[0] > epoch - self.slow_slots:
                slow.extend(entry[1])
        slow.sort(key=lambda item: -item[0])
        slowest = [self._aged(item[2], now) for item in slow[:self.slow_keep]]
        recent = sorted((r for r in self.recent if r is not None), key=lambda r: -r["at"])
        last_slot = self._rate_window(now)
        return {
            "uptime_s": round(now - self.started, 1),
            "requests_total": self.total,
            "rate_rps": last_slot,
            "window_s": self.nslots * self.slot_s,
            "slot_s": self.slot_s,
            "objective": OBJECTIVE,
            "classes": classes,
            "refused_unclassified": refused_unclassified,
            "slowest": slowest,
            "recent": [self._aged(r, now) for r in recent[:50]],
        }

    def _rate_window(self, now: float) -> float:
        """Requests per second over the last full slot and the current one."""
        epoch = int(now / self.slot_s)
        n = 0
        for ring in self._slots.values():
            for s in ring:
                if s is not None and s.epoch >= epoch - 1:
                    n += s.n
        span = self.slot_s + (now - epoch * self.slot_s)
        span = min(span, max(now - self.started, 1e-3))
        return round(n / span, 2) if span > 0 else 0.0

    @staticmethod
    def _aged(row: dict[str, Any], now: float) -> dict[str, Any]:
        out = dict(row)
        out["ago_s"] = round(now - out.pop("at"), 1)
        return out

    def _class_view(self, name: str, live: list[_Slot], first: int, epoch: int) -> dict[str, Any]:
        n = sum(s.n for s in live)
        judged = sum(s.judged for s in live)
        met = sum(s.met for s in live)
        ttft = [0] * _BINS
        tpot = [0] * _BINS
        for s in live:
            for i, c in enumerate(s.ttft):
                if c:
                    ttft[i] += c
            for i, c in enumerate(s.tpot):
                if c:
                    tpot[i] += c
        ttft_n = sum(s.ttft_n for s in live)
        tpot_n = sum(s.tpot_n for s in live)
        t50, t99 = percentiles(ttft, ttft_n, (0.5, 0.99))
        p50, p99 = percentiles(tpot, tpot_n, (0.5, 0.99))
        goodput = met / judged if judged else None
        budget = None
        burn = None
        if judged:
            allowed = (1 - OBJECTIVE) * judged
            budget = round(max(0.0, 1 - (judged - met) / allowed), 3)
            burn = round((1 - met / judged) / (1 - OBJECTIVE), 2)
        by_epoch = {s.epoch: s for s in live}
        series: dict[str, list[Any]] = {"t": [], "ttft_p50": [], "ttft_p99": [], "tpot_p50": [],
                                        "tpot_p99": [], "goodput": [], "n": []}
        for e in range(first, epoch + 1):
            slot = by_epoch.get(e)
            series["t"].append(round((e - epoch) * self.slot_s, 1))
            if slot is None:
                for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "goodput"):
                    series[key].append(None)
                series["n"].append(0)
                continue
            ttft_50, ttft_99 = percentiles(slot.ttft, slot.ttft_n, (0.5, 0.99))
            tpot_50, tpot_99 = percentiles(slot.tpot, slot.tpot_n, (0.5, 0.99))
            series["ttft_p50"].append(ttft_50)
            series["ttft_p99"].append(ttft_99)
            series["tpot_p50"].append(tpot_50)
            series["tpot_p99"].append(tpot_99)
            series["goodput"].append(round(slot.met / slot.judged, 4) if slot.judged else None)
            series["n"].append(slot.n)
        return {"target": self.targets.get(name), "requests": n, "judged": judged, "met": met,
                "goodput": None if goodput is None else round(goodput, 4),
                "budget_left": budget, "burn_rate": burn,
                "ttft_ms": {"p50": t50, "p99": t99, "n": ttft_n},
                "tpot_ms": {"p50": p50, "p99": p99, "n": tpot_n},
                "series": series}
