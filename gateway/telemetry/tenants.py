"""Per-tenant Prometheus metrics, with a bounded tenant label: the configured tenants plus
`other` (open mode, or anything unexpected). Never a key, never a client-chosen string.

  slogate_tenant_requests_total{tenant, slo_class, outcome}
  slogate_tenant_slo_requests_total{tenant, slo_class, verdict}   (verdict="met" is goodput)
  slogate_tenant_tokens_total{tenant, kind}                       (prompt, completion)
  slogate_tenant_sheds_total{tenant, reason}                      (errors.SHED_REASONS)
  slogate_tenant_quota_usage_ratio{tenant, quota}                 (0..1: share of a quota used)
  slogate_tenant_backend_holds_total{tenant, backend}   (its own failures held it off a backend)
  slogate_tenant_held_requests_total{tenant}            (refused at once while held: tenant_held)
  slogate_tenant_ttft_stalls_total{tenant, judged}      (first tokens far later than predicted)
  slogate_tenant_tpot_slow_total{tenant, judged}        (streams decoding far slower than predicted)
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from gateway.errors import SHED_REASONS, STALL_BACKEND, STALL_OWN, TENANT_HELD
from gateway.telemetry.counter import Counter

OTHER = "other"


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, tenants: Iterable[str] = ()) -> None:
        self.known = frozenset(tenants)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter("slogate_tenant_requests", "Finished requests by tenant.",
                                ("tenant", "slo_class", "outcome"), registry=registry)
        self.slo_requests = Counter("slogate_tenant_slo_requests",
                                    "Finished requests by tenant and SLO verdict (met = "
                                    "goodput).", ("tenant", "slo_class", "verdict"),
                                    registry=registry)
        self.tokens = Counter("slogate_tenant_tokens", "Tokens by tenant and kind.",
                              ("tenant", "kind"), registry=registry)
        self.sheds = Counter("slogate_tenant_sheds",
                             "Requests admission refused, by tenant and reason (quota, queue "
                             "full, TTFT out of reach).", ("tenant", "reason"), registry=registry)
        self.quota = Gauge("slogate_tenant_quota_usage_ratio",
                           "Share of a tenant's quota in use (requests/tokens per minute, in "
                           "flight, queued).", ("tenant", "quota"), registry=registry)
        self.backend_holds = Counter("slogate_tenant_backend_holds",
                                     "Times a tenant was held off a backend by its own failures "
                                     "(its requests failed there while other tenants' "
                                     "succeeded).", ("tenant", "backend"), registry=registry)
        self.held_requests = Counter("slogate_tenant_held_requests",
                                     "Requests refused at once (503 tenant_held) because their "
                                     "tenant was held off every backend that could serve them.",
                                     ("tenant",), registry=registry)
        self.ttft_stalls = Counter("slogate_tenant_ttft_stalls",
                                   "First tokens far later than admission predicted, by tenant "
                                   "and how they were judged: backend (another tenant's were "
                                   "late too, or it is alone there: the estimator learned it) "
                                   "or own (the tenant's alone: it did not).",
                                   ("tenant", "judged"), registry=registry)
        self.tpot_slows = Counter("slogate_tenant_tpot_slow",
                                  "Streams whose TPOT was far above what admission predicted, "
                                  "by tenant and how they were judged: backend (another "
                                  "tenant's were slow too, or it is alone there: the estimator "
                                  "learned it) or own (the tenant's alone: it did not).",
                                  ("tenant", "judged"), registry=registry)
        for tenant in (*sorted(self.known), OTHER):
            for reason in SHED_REASONS:
                self.sheds.labels(tenant, reason)
            self.held_requests.labels(tenant)
            for judged in (STALL_OWN, STALL_BACKEND):
                self.ttft_stalls.labels(tenant, judged)
                self.tpot_slows.labels(tenant, judged)

    def label(self, tenant: str | None) -> str:
        return tenant if tenant in self.known else OTHER

    def _child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe(self, ctx: Any) -> None:
        """One finished request."""
        tenant = self.label(ctx.tenant_label)
        cls = ctx.slo.name if ctx.slo is not None else "none"
        self._child(self.requests, (tenant, cls, ctx.outcome or "unknown")).inc()
        if ctx.verdict:
            self._child(self.slo_requests, (tenant, cls, ctx.verdict)).inc()
        if ctx.prompt_tokens:
            self._child(self.tokens, (tenant, "prompt")).inc(ctx.prompt_tokens)
        if ctx.completion_tokens:
            self._child(self.tokens, (tenant, "completion")).inc(ctx.completion_tokens)
        if ctx.error_type == TENANT_HELD:
            self._child(self.held_requests, (tenant,)).inc()

    def ttft_stall(self, tenant: str, judged: str) -> None:
        self._child(self.ttft_stalls, (self.label(tenant), judged)).inc()

    def tpot_slow(self, tenant: str, judged: str) -> None:
        self._child(self.tpot_slows, (self.label(tenant), judged)).inc()

    def backend_held(self, backend: str, tenant: str) -> None:
        self._child(self.backend_holds, (self.label(tenant), backend)).inc()

    def shed(self, tenant: str, reason: str) -> None:
        self._child(self.sheds, (self.label(tenant), reason)).inc()

    def quota_usage(self, tenant: str, usage: Mapping[str, float]) -> None:
        for quota, value in usage.items():
            self._child(self.quota, (self.label(tenant), quota)).set(value)
