"""Online estimators per backend replica, learned from the gateway's own observations.

TTFT (upstream: request sent -> first token) is modelled as
    c0 + c1 * W + c2 * W * D + c3 * N
with W = prompt tokens ahead of and including this request's (thousands), D = streams decoding
on the replica, N = requests ahead of it not yet past their first token: a continuous-batching
engine prefills in chunks interleaved with decode steps, so the time per prefilled token grows
with the batch; and once its batch is full, a request waits for a slot, which grows with the
requests queued ahead of it. TPOT is a + b * D.

Both are recursive least squares with a forgetting factor, so they follow a backend that gets
faster or slower. Prompt tokens are estimated from request bytes with a ratio calibrated
against reported usage.prompt_tokens: per tenant, robust and bounded (`TokenCalibration`).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

RATIO_MIN, RATIO_MAX = 0.005, 1.0  # tokens per request byte: the bounds any estimate keeps
RATIO_PRIOR = 0.25
RATIO_WINDOW = 32
RATIO_MIN_SAMPLES = 4


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


class TokenCalibration:
    """Request bytes -> prompt tokens, learned from reported usage, one ratio per tenant.

    A tenant's ratio is the median of its last RATIO_WINDOW observed ratios, each clamped to
    [RATIO_MIN, RATIO_MAX]: one odd prompt moves nothing, and a tenant must change most of its
    recent traffic to move its own estimate, never another tenant's. A tenant with fewer than
    RATIO_MIN_SAMPLES observations uses the median of the other tenants' ratios (one vote per
    tenant), else the prior. Memory is bounded: tenants are the configured ones plus `other`."""

    def __init__(self, prior: float = RATIO_PRIOR) -> None:
        self.prior = prior
        self.windows: dict[str, deque[float]] = {}
        self._ratio: dict[str, float] = {}

    def observe(self, tenant: str, body_bytes: int, prompt_tokens: int) -> None:
        if body_bytes <= 0 or prompt_tokens <= 0:
            return
        w = self.windows.get(tenant)
        if w is None:
            w = self.windows[tenant] = deque(maxlen=RATIO_WINDOW)
        w.append(min(RATIO_MAX, max(RATIO_MIN, prompt_tokens / body_bytes)))
        if len(w) >= RATIO_MIN_SAMPLES:
            self._ratio[tenant] = _median(w)

    def ratio(self, tenant: str) -> float:
        own = self._ratio.get(tenant)
        if own is not None:
            return own
        if self._ratio:
            return _median(list(self._ratio.values()))
        return self.prior

    def snapshot(self) -> dict[str, float]:
        return {t: round(r, 5) for t, r in self._ratio.items()}


class RLS:
    """Recursive least squares y ≈ θ·x with exponential forgetting (λ < 1 forgets).
    Coefficients listed in `nonneg` are projected onto >= 0 after each update: a cost per
    token or per stream cannot be negative, and a fit that says so is compensating for
    something else (the usual failure when features are correlated)."""

    P_MAX = 1000.0

    def __init__(self, theta: Sequence[float], lam: float, p0: float = 100.0,
                 nonneg: Sequence[int] = ()) -> None:
        n = len(theta)
        self.nonneg = tuple(nonneg)
        self.theta = list(theta)
        self.lam = lam
        self.P = [[p0 if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.n = 0
        self.err_var = 0.0  # EWMA of squared residuals (same forgetting)

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def update(self, x: Sequence[float], y: float) -> None:
        n = len(x)
        P = self.P
        Px = [sum(P[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = self.lam + sum(x[i] * Px[i] for i in range(n))
        k = [v / denom for v in Px]
        err = y - self.predict(x)
        self.theta = [t + ki * err for t, ki in zip(self.theta, k, strict=True)]
        self.P = [[(P[i][j] - k[i] * Px[j]) / self.lam for j in range(n)] for i in range(n)]
        for i in self.nonneg:
            if self.theta[i] < 0 and self.P[i][i] > 0:
                # Project onto theta_i = 0 in the metric of the information matrix (the
                # constrained least-squares estimate): the correlated coefficients move with
                # it. Clamping theta_i alone let the intercept run away when the data barely
                # varies a feature (a concurrency limit holds the batch steady): each update's
                # gain then raised the intercept while the slope was pushed below zero.
                c = self.theta[i] / self.P[i][i]
                self.theta = [t - c * self.P[j][i] for j, t in enumerate(self.theta)]
                self.theta[i] = 0.0
        # Forgetting inflates P in directions the data does not excite (D stays 0, say);
        # bound it so one odd observation cannot swing θ wildly ("covariance wind-up").
        trace = sum(self.P[i][i] for i in range(n))
        if trace > self.P_MAX * n:
            f = self.P_MAX * n / trace
            self.P = [[v * f for v in row] for row in self.P]
        w = 1.0 - self.lam if self.n > 10 else 1.0 / (self.n + 1)
        self.err_var = (1 - w) * self.err_var + w * err * err
        self.n += 1

    @property
    def stderr(self) -> float:
        return math.sqrt(self.err_var)


class ReplicaEstimator:
    def __init__(self, lam: float = 0.97) -> None:
        # Priors for an unknown engine: 50 ms base, 1 s per 1k prompt tokens, 20 ms TPOT.
        self.ttft = RLS([0.05, 0.2, 0.0, 0.0], lam, nonneg=(1, 2, 3))
        self.tpot = RLS([0.02, 0.001], lam, nonneg=(1,))
        self.tokens_per_byte = RATIO_PRIOR
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)
        self.provider_queue_s = 0.0  # EWMA of provider-reported queue time (hosted APIs)

    @staticmethod
    def _ttft_x(work_tokens: float, decoding: float, ahead: float) -> list[float]:
        w = work_tokens / 1000.0
        return [1.0, w, w * decoding, ahead]

    def predict_ttft(self, work_tokens: float, decoding: float, ahead: float = 0.0) -> float:
        base = self.ttft.theta[0]
        pred = self.ttft.predict(self._ttft_x(work_tokens, decoding, ahead))
        return max(pred, base, 0.0) + self.provider_queue_s

    def predict_tpot(self, decoding: float) -> float:
        return max(self.tpot.predict([1.0, decoding]), 0.0)

    @property
    def ttft_error_s(self) -> float:
        """The estimator's stated error: two standard deviations of recent residuals."""
        return 2.0 * self.ttft.stderr

    def observe_ttft(self, work_tokens: float, decoding: float, ahead: float,
                     seconds: float) -> None:
        self.ttft.update(self._ttft_x(work_tokens, decoding, ahead), seconds)

    def observe_tpot(self, decoding: float, seconds: float) -> None:
        self.tpot.update([1.0, decoding], seconds)

    def observe_prompt(self, body_bytes: int, prompt_tokens: int) -> None:
        """The replica's own ratio (shown in /admin/admission): the same robust median."""
        if body_bytes > 0 and prompt_tokens > 0:
            self._ratios.append(min(RATIO_MAX, max(RATIO_MIN, prompt_tokens / body_bytes)))
            if len(self._ratios) >= RATIO_MIN_SAMPLES:
                self.tokens_per_byte = _median(self._ratios)

    def observe_provider_queue(self, seconds: float) -> None:
        self.provider_queue_s += 0.2 * (seconds - self.provider_queue_s)

    def snapshot(self) -> dict[str, Any]:
        c0, c1, c2, c3 = self.ttft.theta
        a, b = self.tpot.theta
        return {
            "ttft_model": {"base_s": round(c0, 5), "s_per_1k_prompt_tokens": round(c1, 5),
                           "s_per_1k_tokens_per_decoding_stream": round(c2, 6),
                           "s_per_request_ahead": round(c3, 5),
                           "observations": self.ttft.n,
                           "stated_error_s": round(self.ttft_error_s, 5)},
            "tpot_model": {"base_s": round(a, 6), "s_per_decoding_stream": round(b, 7),
                           "observations": self.tpot.n, "stderr_s": round(self.tpot.stderr, 6)},
            "tokens_per_byte": round(self.tokens_per_byte, 4),
            "provider_queue_s": round(self.provider_queue_s, 5),
        }
