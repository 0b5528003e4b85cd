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

One tenant's outliers must not teach the shared TTFT fit, nor widen the error every tenant's
admission is padded with (`TtftJudge`): each tenant keeps its own residuals, the error is a
robust spread of them (a bounded quantile over a window), and a first token far later than
predicted is judged as the stall it is before it may teach the fit: only when another
tenant's first tokens are late too, or the tenant is alone on the replica (then the other
tenants are predicted from the fit as it was before, until one of them confirms or
contradicts it).
"""
from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from gateway.errors import STALL_BACKEND, STALL_OWN

RATIO_MIN, RATIO_MAX = 0.005, 1.0  # tokens per request byte: the bounds any estimate keeps
RATIO_PRIOR = 0.25
RATIO_WINDOW = 32
RATIO_MIN_SAMPLES = 4

# A tenant's residuals (actual - predicted TTFT, s) on one replica: the last RESID_WINDOW; its
# own spread and bias need RESID_MIN of them (until then it gets the replica's).
RESID_WINDOW = 32
RESID_MIN = 8
# A tenant's spread: the 90th percentile of its residuals' sizes, as a standard deviation (of
# normal residuals, 1.645 of them); its few larger ones (1 in 10) are its own outliers and move
# nothing. Two-sided: a fit that is off for the tenant either way is an error of its own.
SPREAD_QUANTILE = 0.9
SPREAD_SIGMAS = 1.645
SPREAD_FLOOR_S = 0.002
# A stall: a first token late by all of these over the prediction. Not judged before the fit
# has WARM_N observations (its priors are not a prediction).
STALL_SIGMAS = 6.0  # the replica's spread of residuals that were not stalls,
STALL_RATIO = 1.0  # the prediction itself (TTFT at least twice the predicted),
STALL_MIN_S = 0.05  # and this much.
WARM_N = 10
STALL_WINDOW_S = 30.0  # another tenant's stall within this long corroborates one
STALL_ALONE = 3  # stalls of a tenant alone on the replica (within the window) that teach the fit
# A slow stream: a TPOT above TPOT_SLOW_RATIO × the prediction and TPOT_SLOW_MIN_S over it.
TPOT_SLOW_RATIO = 2.0
TPOT_SLOW_MIN_S = 0.005


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
    WARM = WARM_N  # observations before its residuals measure the engine, not the priors

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
        # Project onto theta_i = 0 in the metric of the information matrix (the constrained
        # least-squares estimate): the correlated coefficients move with it. Clamping
        # theta_i alone let the intercept run away when the data barely varies a feature (a
        # concurrency limit holds the batch steady): each update's gain then raised the
        # intercept while the slope was pushed below zero. Projecting one coefficient can
        # push another below zero (per-stream cost to 0 took the per-token cost to -0.06 s
        # per 1k, and the per-request cost to +0.23 s): repeated until none is.
        for _ in range(len(self.nonneg)):  # the most negative first, then again
            i = min(self.nonneg, key=lambda j: self.theta[j])
            if self.theta[i] >= 0:
                break
            if self.P[i][i] > 0:
                c = self.theta[i] / self.P[i][i]
                self.theta = [t - c * self.P[j][i] for j, t in enumerate(self.theta)]
            self.theta[i] = 0.0
        for i in self.nonneg:  # what the passes left (rare): clamped
            self.theta[i] = max(0.0, self.theta[i])
        # Forgetting inflates P in directions the data does not excite (D stays 0, say);
        # bound it so one odd observation cannot swing θ wildly ("covariance wind-up").
        trace = sum(self.P[i][i] for i in range(n))
        if trace > self.P_MAX * n:
            f = self.P_MAX * n / trace
            self.P = [[v * f for v in row] for row in self.P]
        # The residual deviation counts from the WARM-th observation: before, the errors are
        # the priors' (an unknown engine), and a stated error made of them would refuse
        # requests the engine serves in time.
        if self.n >= self.WARM:
            seen = self.n - self.WARM
            w = 1.0 - self.lam if seen > 10 else 1.0 / (seen + 1)
            self.err_var = (1 - w) * self.err_var + w * err * err
        self.n += 1

    @property
    def stderr(self) -> float:
        return math.sqrt(self.err_var)


def _spread(residuals: Sequence[float]) -> float:
    sizes = sorted(abs(v) for v in residuals)
    return max(SPREAD_FLOOR_S, sizes[math.ceil(SPREAD_QUANTILE * len(sizes)) - 1] / SPREAD_SIGMAS)


def _lower_median(values: Iterable[float]) -> float | None:
    """One vote per tenant; with two, the smaller (one tenant cannot move it)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


class Residual:
    """One observation's residual, whether it was a stall (`late`), and whether it is still
    its tenant's own (its bias) or was judged the replica's (the fit learned it)."""

    __slots__ = ("value", "own", "late")

    def __init__(self, value: float) -> None:
        self.value = value
        self.own = True
        self.late = False


class Stall:
    """A first token far later than predicted (or a stream far slower), held back from the
    fit until judged: when it came, the fit's inputs and what was observed."""

    __slots__ = ("t", "x", "y", "residual")

    def __init__(self, t: float, x: list[float], y: float, residual: Residual) -> None:
        self.t, self.x, self.y, self.residual = t, x, y, residual


class HeldStalls:
    """Per tenant on one replica: when it was last seen, and its stalls held back from the fit
    (at most RESID_WINDOW each, for STALL_WINDOW_S) — what judging one tenant's word against
    the others' needs, for first tokens and for streams alike."""

    def __init__(self) -> None:
        self.stalls: dict[str, deque[Stall]] = {}
        self.last_seen: dict[str, float] = {}

    def others_seen(self, tenant: str, now: float) -> bool:
        return any(t != tenant and now - seen < STALL_WINDOW_S
                   for t, seen in self.last_seen.items())

    def expire(self, now: float) -> None:
        for queue in self.stalls.values():
            while queue and now - queue[0].t >= STALL_WINDOW_S:
                queue.popleft()

    def held(self, tenant: str) -> deque[Stall]:
        queue = self.stalls.get(tenant)
        if queue is None:
            queue = self.stalls[tenant] = deque(maxlen=RESID_WINDOW)
        return queue

    def partner(self, tenant: str) -> str | None:
        """Another tenant with a stall held (the slowdown is not this tenant's alone)."""
        return next((t for t, queue in self.stalls.items() if t != tenant and queue), None)


class TtftJudge(HeldStalls):
    """Per tenant on one replica: its residuals, its spread and bias, and its stalls that have
    not taught the shared fit. Memory is bounded: tenants are the configured ones plus
    `other`, each with at most RESID_WINDOW residuals and stalls.

    - A tenant's spread is the SPREAD_QUANTILE of its residuals' sizes (as one standard
      deviation); the replica's is the lower median of its tenants' (one vote each: with two
      tenants, the smaller). A request is padded with the larger of its tenant's and the
      replica's.
    - A tenant's bias is the median of its residuals (those the fit learned count as 0),
      never below 0: a tenant whose requests are slow for a reason of its own is predicted
      slow itself, nobody else is.
    - A stall is judged against the spread of residuals that were not stalls (so no stall,
      learned or not, makes the next one look ordinary). It teaches the fit when another
      tenant has a stall held within STALL_WINDOW_S (the engine got slower for both: the two
      teach it together, one for one, so that one late first token cannot release another
      tenant's backlog), or when no other tenant was seen within it and this tenant has
      STALL_ALONE (a slowdown only it can see). Else it stays the tenant's own.
    - Taught on one tenant's word alone, the fit as it was before is kept for the others
      (`before`): the first first-token of another tenant decides. Late by that fit too: the
      slowdown is the replica's (the old fit goes). As that fit predicted: the stalls were
      that tenant's own (the old fit comes back, and they count in its bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.residuals: dict[str, deque[Residual]] = {}
        # each tenant's last late first token as it came (for the concurrency limit)
        self.late: dict[str, float] = {}
        self.spreads: dict[str, float] = {}
        self.biases: dict[str, float] = {}
        self.spread: float | None = None  # the replica's, once some tenant has RESID_MIN
        self.ordinary: dict[str, float] = {}  # each tenant's spread of residuals not stalls
        self.reference: float | None = None  # the replica's: what a stall is judged against
        self.before: RLS | None = None  # the fit before one tenant alone taught it
        self.teacher: str | None = None
        self.taught: list[Residual] = []  # that tenant's residuals the fit learned

    def record(self, tenant: str, value: float, keep: bool = True) -> Residual:
        """A residual of `tenant`'s; kept in its window (its spread and bias) with `keep`."""
        residual = Residual(value)
        if keep:
            window = self.residuals.get(tenant)
            if window is None:
                window = self.residuals[tenant] = deque(maxlen=RESID_WINDOW)
            window.append(residual)
        return residual

    def refresh(self, tenant: str) -> None:
        """Recompute a tenant's spread and bias (once per observation, not per prediction)."""
        window = self.residuals.get(tenant, ())
        if len(window) >= RESID_MIN:
            self.spreads[tenant] = _spread([r.value for r in window])
            self.biases[tenant] = max(0.0, _median([r.value if r.own else 0.0
                                                    for r in window]))
        ordinary = [r.value for r in window if not r.late]
        if len(ordinary) >= RESID_MIN:
            self.ordinary[tenant] = _spread(ordinary)
        self.spread = _lower_median(self.spreads.values())
        self.reference = _lower_median(self.ordinary.values())

    def spread_for(self, tenant: str | None) -> float | None:
        own = self.spreads.get(tenant) if tenant is not None else None
        if self.spread is None:
            return own
        return self.spread if own is None else max(own, self.spread)

    def others_late(self, tenant: str, now: float) -> bool:
        """Was another tenant's first token late here within the window (as it came)?"""
        return any(t != tenant and now - at < STALL_WINDOW_S for t, at in self.late.items())


class TpotJudge(HeldStalls):
    """Whose slow streams teach a replica's TPOT fit. A stream decoding far slower than
    predicted for a reason of its tenant's own (a grammar, logprobs, a fault it injected) must
    not get every tenant's tight-TPOT requests refused. Judged like first tokens, simpler (a
    slow stream refuses nobody by itself, so there is no bias or spread per tenant): a slow
    stream teaches the fit when another tenant has a slow one held (both teach it, one for
    one), or when no other tenant was seen within STALL_WINDOW_S (a slowdown only it can see);
    else it is held, and teaches nothing unless another tenant's slow stream pairs with it."""

    def judge(self, fit: RLS, tenant: str, x: list[float], seconds: float,
              now: float) -> tuple[str | None, list[tuple[list[float], float]]]:
        """(None: ordinary, STALL_BACKEND or STALL_OWN; the (x, tpot) pairs to teach)."""
        alone = not self.others_seen(tenant, now)
        self.last_seen[tenant] = now
        self.expire(now)
        pred = max(fit.predict(x), 0.0)
        if not (fit.n >= WARM_N and seconds > TPOT_SLOW_RATIO * pred
                and seconds - pred > TPOT_SLOW_MIN_S):
            return None, [(x, seconds)]
        partner = self.partner(tenant)
        if partner is not None:
            paired = self.stalls[partner].pop()
            return STALL_BACKEND, [(paired.x, paired.y), (x, seconds)]
        if alone:
            return STALL_BACKEND, [(x, seconds)]
        self.held(tenant).append(Stall(now, x, seconds, Residual(seconds - pred)))
        return STALL_OWN, []


class ReplicaEstimator:
    def __init__(self, lam: float = 0.97) -> None:
        # Priors for an unknown engine: 50 ms base, 200 ms per 1k prompt tokens, 20 ms TPOT.
        self.ttft = RLS([0.05, 0.2, 0.0, 0.0], lam, nonneg=(1, 2, 3))
        self.tpot = RLS([0.02, 0.001], lam, nonneg=(1,))
        self.judge = TtftJudge()
        self.tpot_judge = TpotJudge()
        self.tokens_per_byte = RATIO_PRIOR
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)
        self.provider_queue_s = 0.0  # EWMA of provider-reported queue time (hosted APIs)

    @staticmethod
    def _ttft_x(work_tokens: float, decoding: float, ahead: float) -> list[float]:
        w = work_tokens / 1000.0
        return [1.0, w, w * decoding, ahead]

    def _fit_for(self, tenant: str | None) -> RLS:
        """The fit a tenant is predicted with: the shared one, unless one other tenant alone
        taught it a slowdown that nobody else confirmed yet."""
        judge = self.judge
        if judge.before is not None and tenant is not None and tenant != judge.teacher:
            return judge.before
        return self.ttft

    @staticmethod
    def _point(fit: RLS, x: Sequence[float]) -> float:
        return max(fit.predict(x), fit.theta[0], 0.0)

    def predict_ttft(self, work_tokens: float, decoding: float, ahead: float = 0.0,
                     tenant: str | None = None) -> float:
        """Upstream TTFT of a new request (of `tenant`: with its own bias; None: the
        replica's view)."""
        x = self._ttft_x(work_tokens, decoding, ahead)
        pred = self._point(self._fit_for(tenant), x) + self.provider_queue_s
        return pred + self.judge.biases.get(tenant, 0.0) if tenant is not None else pred

    def prefill_s(self, work_tokens: float, decoding: float) -> float:
        """The fit's time to prefill `work_tokens` beside `decoding` streams: its prediction
        less the term for requests waiting ahead and the provider's queue (what is left of a
        first token beyond this is a wait)."""
        return self.ttft.predict(self._ttft_x(work_tokens, decoding, 0.0))

    def predict_tpot(self, decoding: float) -> float:
        return max(self.tpot.predict([1.0, decoding]), 0.0)

    def ttft_spread_s(self, tenant: str | None = None) -> float:
        """One (robust) standard deviation of TTFT residuals, what admission pads a request
        of `tenant` with: the larger of its own and the replica's; the fit's own (RLS)
        residual deviation until some tenant has enough residuals."""
        spread = self.judge.spread_for(tenant)
        return self.ttft.stderr if spread is None else spread

    @property
    def ttft_error_s(self) -> float:
        """The estimator's stated error: two (robust) standard deviations of residuals."""
        return 2.0 * self.ttft_spread_s()

    def observe_ttft(self, work_tokens: float, decoding: float, ahead: float,
                     seconds: float, tenant: str = "", now: float = 0.0) -> str | None:
        """One first token of `tenant` (`now`: monotonic s). None: it taught the fit as an
        ordinary observation; else a stall, judged STALL_BACKEND (it taught the fit, with
        the stalls that corroborate it) or STALL_OWN (held: the tenant's own)."""
        judge = self.judge
        x = self._ttft_x(work_tokens, decoding, ahead)
        fit = self._fit_for(tenant)
        pred = self._point(fit, x)
        # A fit with fewer than WARM_N observations is still its priors: its residuals say
        # how little it knows, not how much the engine varies (kept, a few of them would pad
        # every request for a whole window, and refuse tight classes the engine could serve).
        residual = judge.record(tenant, seconds - pred, keep=fit.n >= WARM_N)
        alone = not judge.others_seen(tenant, now)
        judge.last_seen[tenant] = now
        judge.expire(now)
        verdict: str | None = None
        if not self._late(fit, residual.value, pred):
            if fit is not self.ttft:  # as the fit before said: that teaching was one tenant's
                self._untaught()
            self.ttft.update(x, seconds)
        else:
            residual.late = True
            held = judge.held(tenant)
            partner = judge.partner(tenant)
            if partner is not None or fit is not self.ttft:  # another tenant's were late too
                judge.before, judge.teacher, judge.taught = None, None, []
                # One for one: a single late first token cannot release another tenant's
                # whole backlog of stalls into the fit.
                paired = [judge.stalls[partner].pop()] if partner is not None else []
                self._teach(paired, x, seconds, residual)
                if partner is not None:
                    judge.refresh(partner)
                verdict = STALL_BACKEND
            elif judge.teacher == tenant or (alone and len(held) + 1 >= STALL_ALONE):
                if judge.before is None:  # the others keep the fit as it was
                    judge.before, judge.teacher = copy.deepcopy(self.ttft), tenant
                judge.taught.extend([*(s.residual for s in held), residual])
                self._teach(list(held), x, seconds, residual)
                held.clear()
                verdict = STALL_BACKEND
            else:
                held.append(Stall(now, x, seconds, residual))
                verdict = STALL_OWN
        judge.refresh(tenant)
        return verdict

    def _late(self, fit: RLS, residual: float, pred: float) -> bool:
        """Is this residual a stall? (Before any tenant has enough ordinary residuals, judged
        against the fit's own residual deviation.)"""
        reference = self.judge.reference
        spread = max(SPREAD_FLOOR_S, fit.stderr if reference is None else reference)
        return (fit.n >= WARM_N and residual > STALL_SIGMAS * spread
                and residual > STALL_RATIO * pred and residual > STALL_MIN_S)

    def own_stall(self, work_tokens: float, decoding: float, ahead: float, seconds: float,
                  tenant: str, now: float) -> bool:
        """A first token as it comes (before its request ends and teaches the fit): is it a
        stall of its tenant's own so far (late, other tenants use the replica, and none of
        theirs was late)? Then it is not a sign of the engine queueing either (admission's
        concurrency limit skips it). A late one is noted: it corroborates others'."""
        fit = self._fit_for(tenant)
        pred = self._point(fit, self._ttft_x(work_tokens, decoding, ahead))
        judge = self.judge
        if not self._late(fit, seconds - pred, pred):
            return False
        own = (judge.others_seen(tenant, now) and not judge.others_late(tenant, now)
               and not any(q for t, q in judge.stalls.items() if t != tenant)
               and fit is self.ttft and judge.teacher != tenant)
        judge.late[tenant] = now
        return own

    def _teach(self, stalls: Sequence[Stall], x: list[float], seconds: float,
               residual: Residual) -> None:
        """Stalls judged the replica's: the fit learns them, in order, and they leave their
        tenants' biases."""
        for s in stalls:
            self.ttft.update(s.x, s.y)
            s.residual.own = False
        self.ttft.update(x, seconds)
        residual.own = False

    def _untaught(self) -> None:
        """Another tenant's first token came as the fit from before predicted: the stalls
        one tenant alone taught were its own. That fit comes back; they count in its bias."""
        judge = self.judge
        assert judge.before is not None and judge.teacher is not None
        self.ttft = judge.before
        for r in judge.taught:
            r.own = True
        teacher = judge.teacher
        judge.before, judge.teacher, judge.taught = None, None, []
        judge.refresh(teacher)

    def observe_tpot(self, decoding: float, seconds: float, tenant: str = "",
                     now: float = 0.0) -> str | None:
        """One stream's TPOT (`decoding`: mean streams decoding beside it). None: ordinary,
        taught; else a slow stream judged STALL_BACKEND (taught) or STALL_OWN (held)."""
        verdict, teach = self.tpot_judge.judge(self.tpot, tenant, [1.0, decoding], seconds, now)
        for x, y in teach:
            self.tpot.update(x, y)
        return verdict

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
                           "stated_error_s": round(self.ttft_error_s, 5),
                           "fit_stderr_s": round(self.ttft.stderr, 5)},
            "ttft_tenants": {t: {"observations": len(self.judge.residuals[t]),
                                 "bias_s": round(self.judge.biases.get(t, 0.0), 5),
                                 "spread_s": round(self.judge.spreads.get(t, 0.0), 5),
                                 "held_stalls": len(self.judge.stalls.get(t, ()))}
                             for t in self.judge.residuals},
            "ttft_taught_by": self.judge.teacher,
            "tpot_model": {"base_s": round(a, 6), "s_per_decoding_stream": round(b, 7),
                           "observations": self.tpot.n, "stderr_s": round(self.tpot.stderr, 6),
                           "held_slow": {t: len(q) for t, q in self.tpot_judge.stalls.items()
                                         if q}},
            "tokens_per_byte": round(self.tokens_per_byte, 4),
            "provider_queue_s": round(self.provider_queue_s, 5),
        }
