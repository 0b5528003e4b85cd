"""Prometheus metrics (`GET /metrics`), names prefixed `slogate_`, in seconds.

Labels are bounded: backend, model (configured names; anything else is `other`), route,
slo_class, outcome / verdict / reason / phase / kind. Never a request id or a key; tenants only
in telemetry/tenants.py's series (configured tenants + `other`).

Histograms are our own small implementation so a request's inter-token gaps can be added in one
pass at the end of the request (prometheus_client's Histogram takes a lock per observation);
the exposition is the standard classic histogram.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from operator import add as _plus
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from gateway.edge import limits
from gateway.exchange import Exchange
from gateway.telemetry import durations as D
from gateway.telemetry.attribution import TTFTSplit, cache_bucket, prompt_bucket
from gateway.telemetry.counter import Counter, Gauge as UnlabelledGauge
from gateway.telemetry.tenants import TenantMetrics
from gateway.timeline import Gaps
from gateway.upstream.health import STATE_NAMES

# TTFT / E2E reach 600 s (reasoning models think for minutes); fine enough at the low end for
# hosted fast engines.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6,
                   0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
                   45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04,
                 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0)
# Signed residuals (actual - predicted, s): negative = sooner than predicted.
RESIDUAL_BUCKETS = (-5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0, 0.01, 0.025,
                    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 1.0)


class Histogram(Collector):
    """A labelled classic histogram, with a bulk observation of a stream's inter-token gaps."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str],
                 buckets: Iterable[float]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(sorted(set(buckets)))
        self.bounds_ns = tuple(int(b * 1e9) for b in self.bounds)
        self._le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        # labels -> [bucket counts, sum, {bucket index: Exemplar}]
        self._series: dict[tuple[str, ...], list[Any]] = {}

    def series(self, labels: tuple[str, ...]) -> list[Any]:
        """The series of `labels` ([bucket counts, sum, {bucket index: Exemplar}]), created
        on first use: a series exists once something was observed in it."""
        s = self._series.get(labels)
        if s is None:
            s = self._series[labels] = [[0] * (len(self.bounds) + 1), 0.0, {}]
        return s

    _get = series  # the name the ITL tests read a series by

    def add(self, s: list[Any], value: float, trace_id: str | None = None) -> None:
        """One observation into a series of this histogram's (`series`)."""
        i = bisect_left(self.bounds, value)
        s[0][i] += 1
        s[1] += value
        if trace_id is not None:
            s[2][i] = Exemplar({"trace_id": trace_id}, value, time.time())

    def observe(self, labels: tuple[str, ...], value: float, trace_id: str | None = None) -> None:
        """One observation; with `trace_id`, it becomes the bucket's exemplar (OpenMetrics), so
        a dashboard can jump from a latency to a trace that had it."""
        self.add(self.series(labels), value, trace_id)

    def observe_gaps(self, labels: tuple[str, ...], gaps: Gaps) -> None:
        """A stream's inter-token gaps, counted in its buckets (gateway/timeline.py): added
        bucket by bucket when they were counted over this histogram's bounds (the proxy's
        exchanges are), else each at the middle of the bucket it was counted in."""
        s = self.series(labels)
        counts = s[0]
        if gaps.bounds_ns == self.bounds_ns:
            s[0] = list(map(_plus, counts, gaps.counts))  # in C: a loop here costs ~1 µs
        else:
            for value, n in gaps.midpoints_s():
                counts[bisect_left(self.bounds, value)] += n
        s[1] += gaps.total_s()

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for labels, (counts, total, exemplars) in list(self._series.items()):
            cum, buckets = 0, []
            for i, (le, c) in enumerate(zip(self._le, counts, strict=True)):
                cum += c
                ex = exemplars.get(i)
                buckets.append((le, cum, ex) if ex is not None else (le, cum))
            fam.add_metric(list(labels), buckets, total)
        yield fam

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)


class _Row:
    """The label tuples of one (backend, model, route, slo_class, stream) and the histogram
    series and counter children of it that requests have used so far, each fetched on first
    use (so no series exists that nothing was observed in): a finished request's dozen
    observations without building and hashing a label tuple for each."""

    __slots__ = ("base", "with_slo", "with_stream", "used")

    def __init__(self, base: tuple[str, str, str], slo_name: str, stream: bool) -> None:
        self.base = base
        self.with_slo = base + (slo_name,)
        self.with_stream = self.with_slo + ("true" if stream else "false",)
        self.used: dict[Any, Any] = {}

    def series(self, hist: Histogram, labels: tuple[str, ...]) -> list[Any]:
        s = self.used.get(hist)
        if s is None:
            s = self.used[hist] = hist.series(labels)
        return s

    def child(self, counter: Counter, last: str) -> Any:
        """`counter`'s child for this row's base labels and `last`."""
        key = (counter, last)
        c = self.used.get(key)
        if c is None:
            c = self.used[key] = counter.labels(*self.base, last)
        return c


class Metrics:
    """Every Prometheus metric of one gateway, in its own registry."""

    def __init__(self, slo_thresholds_s: Iterable[float] = (), slo_classes: Iterable[str] = (),
                 backend_names: Iterable[str] = (), tenants: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, RSS, fds
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}
        self._rows: dict[tuple[str, str, str, str, bool], _Row] = {}
        thresholds = tuple(slo_thresholds_s)
        lat = LATENCY_BUCKETS + thresholds
        tok = TOKEN_BUCKETS + thresholds
        base = ("backend", "model", "route")
        slo = base + ("slo_class",)

        def hist(name: str, doc: str, labels: Sequence[str], buckets: Iterable[float]) -> Histogram:
            h = Histogram(f"slogate_{name}", doc, labels, buckets)
            self.registry.register(h)
            return h

        self.ttft = hist("time_to_first_token_seconds",
                         "Streamed answers only: time from request received to first generated "
                         "token (content, reasoning or tool call; not role chunks or pings). "
                         "Non-streamed and error answers have none (see request_duration).",
                         slo, lat)
        self.ttft_by_prompt = hist(
            "time_to_first_token_by_prompt_seconds",
            "The same TTFT by prompt-length bucket (prompt tokens) and prefix-cache bucket "
            "(hit: >= 75% of the prompt cached, partial, miss, unknown: not reported).",
            ("backend", "model", "prompt_length", "prefix_cache"), lat)
        self.tpot = hist("time_per_output_token_seconds",
                         "Per request: (last token - first token) / (output tokens - 1).", slo, tok)
        self.itl = hist("inter_token_latency_seconds",
                        "Gap between successive token events of a stream (one per gap).", base, tok)
        self.duration = hist("request_duration_seconds",
                             "Time from request received to the end of the response (every "
                             "request; stream=false: the measure of a non-streamed answer).",
                             slo + ("stream",), lat)
        self.gateway_queue = hist("gateway_queue_seconds",
                                  "Time from request received to its first upstream send (body, "
                                  "admission wait, routing).", base, lat)
        self.connect = hist("upstream_connect_seconds",
                            "Time to open a new upstream connection (pooled reuse not counted).",
                            base, lat)
        self.headers = hist("upstream_headers_seconds",
                            "Time from upstream request sent to upstream response headers.",
                            base, lat)
        self.provider_queue = hist("provider_queue_seconds",
                                   "Queue time reported by the provider (Groq, Cerebras, vLLM).",
                                   base, lat)
        self.provider_prefill = hist("provider_prefill_seconds",
                                     "Prefill (prompt) time reported by the provider.", base, lat)
        self.provider_decode = hist("provider_decode_seconds",
                                    "Decode (completion) time reported by the provider.", base, lat)
        self.overhead = hist("gateway_overhead_seconds",
                             "Time spent in gateway code for a request (ingress to upstream send, "
                             "plus relaying each read).", base, OVERHEAD_BUCKETS)
        self.requests = Counter("slogate_requests", "Finished requests by outcome.",
                                base + ("outcome",), registry=self.registry)
        self.tokens = Counter("slogate_tokens", "Tokens by kind (prompt, completion).",
                              base + ("kind",), registry=self.registry)
        self.prompt_cache = Counter("slogate_prompt_cache_tokens",
                                    "Prompt tokens of answers whose provider reported its prefix "
                                    "cache, by kind: cached (read from it) or uncached.",
                                    ("backend", "model", "kind"), registry=self.registry)
        self.ttft_miss = Counter("slogate_ttft_miss",
                                 "Streamed answers whose TTFT missed their class's target, by "
                                 "the stage with the largest share of that TTFT.",
                                 ("slo_class", "stage"), registry=self.registry)
        self.ttft_miss_seconds = Counter("slogate_ttft_miss_stage_seconds",
                                         "Seconds of each TTFT stage, summed over the answers "
                                         "whose TTFT missed its target.",
                                         ("slo_class", "stage"), registry=self.registry)
        self.slo_requests = Counter("slogate_slo_requests",
                                    "Finished requests by SLO verdict (met = goodput).",
                                    ("backend", "model", "route", "slo_class", "verdict"),
                                    registry=self.registry)
        self.cancellations = Counter("slogate_cancellations",
                                     "Client disconnects by the phase they happened in.",
                                     base + ("phase",), registry=self.registry)
        self.interruptions = Counter("slogate_stream_interruptions",
                                     "Committed streams that ended with an error event.",
                                     base + ("reason",), registry=self.registry)
        self.in_flight = UnlabelledGauge("slogate_requests_in_flight",
                                         "Requests being served now.", registry=self.registry)
        self.queued = Gauge("slogate_requests_queued",
                            "Requests waiting in the gateway's admission queue.",
                            registry=self.registry)
        # Admission (decisions are counted for every request; with admission off every
        # request is admitted with reason "admission_off").
        self.admission = Counter("slogate_admission_decisions",
                                 "Admission decisions by decision and reason.",
                                 ("model", "route", "slo_class", "decision", "reason"),
                                 registry=self.registry)
        self.preemptions = Counter(
            "slogate_admission_preemptions", "Running streams that gave their slot to an "
            "arrival of a class less served than theirs (continued when the next slot "
            "freed), by the arrival's class and the stream's.",
            ("slo_class", "preempted_class"), registry=self.registry)
        self.queue_depth = Gauge("slogate_admission_queue_depth",
                                 "Requests waiting for admission, by SLO class.", ("slo_class",),
                                 registry=self.registry)
        self.queue_wait = hist("admission_queue_wait_seconds",
                               "Time a request waited for admission, by SLO class.",
                               ("slo_class",), lat)
        self.ttft_error = hist("ttft_prediction_error_seconds",
                               "|predicted - actual| TTFT of admitted requests.",
                               ("backend", "model"), lat)
        self.admission_error = hist(
            "admission_prediction_error_seconds",
            "Admission's prediction at the decision vs what happened: actual - predicted "
            "(signed: > 0 later than predicted), for the queue wait (kind=queue_wait) and the "
            "TTFT from request received (kind=ttft), by SLO class.",
            ("slo_class", "kind"), RESIDUAL_BUCKETS)
        # Upstream attempts and replica health.
        self.attempts = Counter("slogate_upstream_attempts",
                                "Upstream attempts by result (ok, or why it was retried/failed).",
                                ("backend", "result"), registry=self.registry)
        self.continuations = Counter(
            "slogate_continuations", "Broken streams continued by a backend from the text "
            "so far, by how the continuation ended (ok, or its attempt result).",
            ("backend", "result"), registry=self.registry)
        self.hedges = Counter(
            "slogate_hedges", "First-token races started (a second attempt for a late first "
            "token), by how they ended: won (the hedge answered), lost (the first attempt "
            "did), failed (the hedge failed), abandoned (the request ended first).",
            ("slo_class", "result"), registry=self.registry)
        self.hedges_skipped = Counter(
            "slogate_hedges_skipped", "First tokens late enough to race that did not, by why: "
            "budget (the tenant's hedge budget is spent), saturated (admission has requests "
            "waiting, or no other replica has room), no_replica.",
            ("slo_class", "reason"), registry=self.registry)
        self.hedge_tokens = Counter(
            "slogate_hedge_tokens", "Tokens spent by the losing attempts of first-token races: "
            "prompt (sent to both) and completion (produced before it was cancelled).",
            ("slo_class", "kind"), registry=self.registry)
        self.breaker = Gauge("slogate_backend_breaker_state",
                             "Circuit breaker per backend replica: 0 closed, 1 half-open, 2 open.",
                             ("backend",), registry=self.registry)
        self.breaker_transitions = Counter("slogate_breaker_transitions",
                                           "Circuit breaker state changes per backend replica, "
                                           "by the state it went to (open, half_open, closed).",
                                           ("backend", "to"), registry=self.registry)
        self.backend_healthy = Gauge("slogate_backend_healthy",
                                     "The active health checks' verdict per backend replica: 1 "
                                     "healthy (or not checked), 0 failing.", ("backend",),
                                     registry=self.registry)
        self.health_check_failures = Counter("slogate_health_check_failures",
                                             "Active health checks that failed, per backend "
                                             "replica.", ("backend",), registry=self.registry)
        self.shared_state = Gauge("slogate_admission_shared_state",
                                  "Where admission keeps its per-replica counts: 1 on the state in "
                                  "use (redis = shared across gateways, local = this gateway's "
                                  "share only, Redis unreachable).", ("state",),
                                  registry=self.registry)
        # The trust boundary: every limit counted (closed label sets, all exposed from zero).
        self.limits_exceeded = Counter("slogate_limits_exceeded",
                                       "Requests and upstream attempts refused or ended by a "
                                       "limit (body timeout, event / response size, ...).",
                                       ("limit",), registry=self.registry)
        self.connections_rejected = Counter("slogate_connections_rejected",
                                            "Client connections refused or closed by a listener "
                                            "limit.", ("reason",), registry=self.registry)
        self.upstream_pool_full = Counter("slogate_upstream_pool_full",
                                          "Upstream requests that waited for a connection: every "
                                          "one of the backend's pool_size connections was in "
                                          "use.", ("backend",), registry=self.registry)
        self.open_connections = Gauge("slogate_open_connections",
                                      "Client connections open now.", registry=self.registry)
        for name in limits.LIMITS:
            self.limits_exceeded.labels(name)
        for name in limits.CONNECTION_REASONS:
            self.connections_rejected.labels(name)
        self.tenants = TenantMetrics(self.registry, tenants)  # telemetry/tenants.py
        for cls in slo_classes:
            self.queue_depth.labels(cls).set(0)
        for name in backend_names:
            self.breaker.labels(name).set(0)
            self.backend_healthy.labels(name).set(1)
            self.health_check_failures.labels(name)
            self.upstream_pool_full.labels(name)
            for state in STATE_NAMES.values():
                self.breaker_transitions.labels(name, state)

    # -- a replica's health (upstream/routing.py's HealthSink) ---------------------------------

    def breaker_changed(self, backend: str, state: int) -> None:
        self.breaker.labels(backend).set(state)
        self.child(self.breaker_transitions, (backend, STATE_NAMES[state])).inc()

    def tenant_held(self, backend: str, tenant: str) -> None:
        self.tenants.backend_held(backend, tenant)

    def health_checked(self, backend: str, ok: bool) -> None:
        self.backend_healthy.labels(backend).set(1 if ok else 0)
        if not ok:
            self.child(self.health_check_failures, (backend,)).inc()

    def pool_full(self, backend: str) -> None:
        self.child(self.upstream_pool_full, (backend,)).inc()

    def child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        """metric.labels(*labels), cached: prometheus_client's lookup costs a lock and a
        label check per call, and every request makes a dozen."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe(self, ctx: Exchange, split: TTFTSplit | None) -> None:
        """Everything about one finished request."""
        child = self.child
        slo_name = ctx.slo.name if ctx.slo is not None else "none"
        key = (ctx.backend or "none", ctx.model_label, ctx.route, slo_name, ctx.stream)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Row(key[:3], slo_name, ctx.stream)
        base, with_slo = row.base, row.with_slo
        row.child(self.requests, ctx.outcome or "unknown").inc()
        if ctx.verdict:
            child(self.slo_requests, with_slo + (ctx.verdict,)).inc()
        trace_id = ctx.trace.trace_id if ctx.trace is not None and ctx.trace.sampled else None
        e2e = D.E2E.seconds(ctx)
        if e2e is not None:
            h = self.duration
            h.add(row.series(h, row.with_stream), e2e, trace_id)
        ttft = D.TTFT.seconds(ctx)
        if ttft is not None:
            h = self.ttft
            h.add(row.series(h, with_slo), ttft, trace_id)
            self.ttft_by_prompt.observe((base[0], base[1], prompt_bucket(ctx), cache_bucket(ctx)),
                                        ttft)
        if split is not None and split.missed:
            child(self.ttft_miss, (slo_name, split.largest)).inc()
            for stage, ns in split.ns.items():
                if ns:
                    child(self.ttft_miss_seconds, (slo_name, stage)).inc(ns / 1e9)
        tpot = D.tpot_s(ctx)
        if tpot is not None:
            h = self.tpot
            h.add(row.series(h, with_slo), tpot)
        gaps = ctx.counted_gaps()
        if gaps is not None:
            self.itl.observe_gaps(base, gaps)
        wait = D.ADMISSION_WAIT.seconds(ctx)
        if wait is not None:
            self.queue_wait.observe((slo_name,), wait)
        queue = D.GATEWAY_QUEUE.seconds(ctx)
        if queue is not None:
            h = self.gateway_queue
            h.add(row.series(h, base), queue)
            h = self.overhead
            h.add(row.series(h, base), D.overhead_s(ctx))
        headers = D.UPSTREAM_HEADERS.seconds(ctx)
        if headers is not None:
            h = self.headers
            h.add(row.series(h, base), headers)
        connect = D.UPSTREAM_CONNECT.seconds(ctx)
        if connect is not None:
            h = self.connect
            h.add(row.series(h, base), connect)
        if ctx.provider_queue_s is not None or ctx.provider_prefill_s is not None \
                or ctx.provider_decode_s is not None:
            self._provider_timing(ctx, base)
        if ctx.prompt_tokens:
            row.child(self.tokens, "prompt").inc(ctx.prompt_tokens)
        if ctx.completion_tokens:
            row.child(self.tokens, "completion").inc(ctx.completion_tokens)
        cached = ctx.cached_tokens
        if cached is not None and ctx.prompt_tokens:
            cached = min(cached, ctx.prompt_tokens)
            child(self.prompt_cache, (base[0], base[1], "cached")).inc(cached)
            child(self.prompt_cache, (base[0], base[1], "uncached")).inc(ctx.prompt_tokens - cached)
        if ctx.cancel_phase:
            row.child(self.cancellations, ctx.cancel_phase).inc()
        if ctx.interruption:
            row.child(self.interruptions, ctx.interruption).inc()
        if ctx.attempts or ctx.error_type in limits.LIMIT_SET:
            for name in _limits_hit(ctx):
                child(self.limits_exceeded, (name,)).inc()

    def _provider_timing(self, ctx: Exchange, base: tuple[str, ...]) -> None:
        """The stages the provider reported (Groq, Cerebras, vLLM): few backends do."""
        for hist, value in ((self.provider_queue, ctx.provider_queue_s),
                            (self.provider_prefill, ctx.provider_prefill_s),
                            (self.provider_decode, ctx.provider_decode_s)):
            if value is not None:
                hist.observe(base, value)


def _limits_hit(ctx: Exchange) -> Iterable[str]:
    """The limits a finished request hit: its own error, and each failed attempt's."""
    for attempt in ctx.attempts:
        if attempt.result in limits.LIMIT_SET:
            yield attempt.result
    if ctx.error_type in limits.LIMIT_SET:
        yield ctx.error_type
