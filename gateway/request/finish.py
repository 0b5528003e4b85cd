"""Finish: everything produced once from the finished context — the SLO verdict, Prometheus
metrics, spans, OTLP metrics, the decision log and the JSON access-log line."""
from __future__ import annotations

from typing import Protocol

from gateway.errors import REJECTED
from gateway.exchange import Exchange
from gateway.request.slo import verdict
from gateway.telemetry import access_log
from gateway.telemetry.attribution import ttft_split
from gateway.telemetry.decisions import DecisionLog
from gateway.telemetry.otlp_metrics import OTLPMetrics
from gateway.telemetry.prometheus import Metrics
from gateway.telemetry.tracing import Tracing


class Recorder(Protocol):
    """A sink of finished records above this layer (the console's recorder)."""

    def record(self, ctx: Exchange) -> None: ...


class Finisher:
    def __init__(self, metrics: Metrics, tracing: Tracing, otlp: OTLPMetrics,
                 prometheus: bool = True, console: Recorder | None = None,
                 decisions: DecisionLog | None = None) -> None:
        self.console = console
        self.decisions = decisions
        self.metrics = metrics
        self.prometheus = prometheus
        self.tracing = tracing
        self.otlp = otlp

    @staticmethod
    def _judged(ctx: Exchange) -> bool:
        """A request the client got wrong (bad JSON, unknown model, bad key) is no SLO miss
        of ours; one shed by admission control is."""
        if ctx.outcome != REJECTED:
            return True
        return ctx.admission is not None and ctx.admission[0] == "rejected"

    def finish(self, ctx: Exchange, operation: str, provider: str) -> None:
        if ctx.slo is not None and ctx.outcome is not None and self._judged(ctx):
            ctx.verdict = verdict(ctx, ctx.slo)
        split = ttft_split(ctx)  # the TTFT's stages, read by every sink below
        if self.prometheus:
            self.metrics.observe(ctx, split)
            self.metrics.tenants.observe(ctx)
        if self.tracing.enabled:
            self.tracing.finish(ctx, operation, provider, split)
        if self.otlp.enabled:
            self.otlp.record(ctx, operation, provider)
        if self.console is not None:
            self.console.record(ctx)
        if self.decisions is not None:
            self.decisions.record(ctx, split)
        access_log.write(ctx, split)
