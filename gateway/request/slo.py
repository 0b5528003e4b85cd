"""SLO classes and per-request verdicts (DistServe goodput: TTFT and TPOT met, outcome ok)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gateway.config import (
    DEFAULT_CLASS,
    OPEN_POLICY,
    SLOClass,
    SLOConfig,
    SLOTarget,
    TenantPolicy,
)
from gateway.errors import OK, GatewayError
from gateway.telemetry import durations

if TYPE_CHECKING:
    from gateway.exchange import Exchange

__all__ = ["DEFAULT_CLASS", "SLOClass", "SLOPolicy", "SLOTarget", "verdict"]

# Closed vocabulary of verdicts.
MET = "met"
TTFT_MISSED = "ttft_missed"
TPOT_MISSED = "tpot_missed"
BOTH_MISSED = "both_missed"
E2E_MISSED = "e2e_missed"
FAILED = "failed"

CLASS_HEADER = "x-slo-class"
TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"


class SLOPolicy:
    """Which SLO target a request is judged against, built from [slo] at start-up."""

    def __init__(self, cfg: SLOConfig) -> None:
        self.cfg = cfg
        self.classes = cfg.classes
        self.default = cfg.default
        self.route_classes = cfg.route_classes
        self.min_ms, self.max_ms = cfg.min_ms, cfg.max_ms
        self.allow_header_overrides = cfg.allow_header_overrides
        # Each class's own target, made once: most requests override nothing (it is frozen).
        self._plain = {name: SLOTarget(cls=c, ttft_ms=c.ttft_ms, tpot_ms=c.tpot_ms,
                                       e2e_ms=c.e2e_ms) for name, c in cfg.classes.items()}

    def target_for(self, route: str, headers: Mapping[str, str],
                   tenant: TenantPolicy = OPEN_POLICY) -> SLOTarget:
        """The class the tenant asked for (x-slo-class) among those its key may use (403
        naming them otherwise), else the route's class when the key may use it, else the
        key's default (the first it lists). A key that lists no classes may use only its
        route's class (open mode: any class). TTFT/TPOT overrides only when the key allows
        them, within the tighter of its bounds and [slo]'s."""
        name = self.route_classes.get(route, self.default)
        if tenant.classes:
            allowed = tenant.classes
            if name not in allowed:
                name = allowed[0]
        else:
            allowed = tuple(self.classes) if tenant.any_class else (name,)
        asked = headers.get(CLASS_HEADER)
        if asked is not None and self.allow_header_overrides:
            if asked not in self.classes:
                raise GatewayError(400, f"Unknown SLO class '{asked[:64]}' in {CLASS_HEADER}; "
                                   f"configured: {sorted(self.classes)}.", "invalid_slo_class")
            if asked not in allowed:
                raise GatewayError(403, f"This key may not use the SLO class '{asked}'; "
                                   f"allowed: {list(allowed)}.", "slo_class_not_allowed",
                                   outcome="rejected")
            name = asked
        cls = self.classes[name]
        ttft, tpot = cls.ttft_ms, cls.tpot_ms
        if self.allow_header_overrides and (TTFT_HEADER in headers or TPOT_HEADER in headers):
            if not tenant.slo_overrides:
                raise GatewayError(403, f"This key may not override SLO targets ({TTFT_HEADER}, "
                                   f"{TPOT_HEADER}); use one of its classes: {list(allowed)}.",
                                   "slo_override_not_allowed", outcome="rejected")
            low = max(self.min_ms, tenant.override_min_ms)
            high = min(self.max_ms, tenant.override_max_ms)
            ttft = self._override(headers, TTFT_HEADER, ttft, low, high)
            tpot = self._override(headers, TPOT_HEADER, tpot, low, high)
            return SLOTarget(cls=cls, ttft_ms=ttft, tpot_ms=tpot, e2e_ms=cls.e2e_ms)
        return self._plain[name]

    @staticmethod
    def _override(headers: Mapping[str, str], header: str, value: float, low: float,
                  high: float) -> float:
        raw = headers.get(header)
        if raw is None:
            return value
        try:
            ms = float(raw)
        except ValueError:
            ms = float("nan")
        if not (low <= ms <= high):
            raise GatewayError(400, f"{header} must be a number of milliseconds between "
                               f"{low:g} and {high:g}.", "invalid_slo_header")
        return ms


def verdict(ctx: Exchange, target: SLOTarget) -> str:
    """A request with a single output token has no TPOT and passes that half (§9.4). A
    non-streamed answer has no first token: with an e2e target it is judged on that alone;
    without one, its whole answer (e2e) must arrive within the TTFT target — it is still not
    a TTFT, and no TTFT histogram sees it."""
    if ctx.outcome != OK:
        return FAILED
    e2e = durations.E2E.seconds(ctx)
    if not ctx.stream:
        if e2e is None:
            return FAILED
        if target.e2e_ms is not None:
            return MET if e2e * 1e3 <= target.e2e_ms else E2E_MISSED
        return MET if e2e * 1e3 <= target.ttft_ms else TTFT_MISSED
    ttft = durations.ttft_s(ctx)
    ttft_ok = ttft is not None and ttft * 1e3 <= target.ttft_ms
    tpot = durations.tpot_s(ctx)
    tpot_ok = tpot is None or tpot * 1e3 <= target.tpot_ms
    if ttft_ok and tpot_ok:
        if target.e2e_ms is not None and e2e is not None and e2e * 1e3 > target.e2e_ms:
            return E2E_MISSED
        return MET
    if not ttft_ok and not tpot_ok:
        return BOTH_MISSED
    return TTFT_MISSED if not ttft_ok else TPOT_MISSED
