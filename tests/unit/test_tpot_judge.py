"""The TPOT estimator against one tenant's slow streams, on an injected clock: streams that
decode slowly for their tenant's own reason (a grammar, logprobs, an injected delay) teach the
shared fit nothing while other tenants' streams are ordinary, so nobody else's tight-TPOT
requests are refused; a slowdown two tenants see, or the only tenant there sees, is learned."""
from __future__ import annotations

import random

import pytest

from gateway.admission.estimator import RESID_WINDOW, STALL_WINDOW_S, ReplicaEstimator
from gateway.errors import STALL_BACKEND, STALL_OWN

DECODING = 4.0  # streams decoding beside each one: the engine below decodes at 20 ms a token


def tpot(rng: random.Random, slow: float = 1.0) -> float:
    return slow * (0.012 + 0.002 * DECODING) + rng.gauss(0, 0.0005)


def warm(est: ReplicaEstimator, tenant: str, rng: random.Random, now: float,
         n: int = 30) -> float:
    for _ in range(n):
        assert est.observe_tpot(DECODING, tpot(rng), tenant, now) is None
        now += 0.1
    return now


def test_one_tenants_slow_streams_are_its_own() -> None:
    rng = random.Random(1)
    est = ReplicaEstimator()
    now = warm(est, "victim", rng, 0.0)
    before = est.predict_tpot(DECODING)
    assert before == pytest.approx(0.02, abs=0.002)
    for _ in range(3 * RESID_WINDOW):  # 5× slower, interleaved with the victim's ordinary ones
        assert est.observe_tpot(DECODING, tpot(rng, 5.0), "attacker", now) == STALL_OWN
        assert est.observe_tpot(DECODING, tpot(rng), "victim", now + 0.05) is None
        now += 0.1
    assert est.predict_tpot(DECODING) == pytest.approx(before, abs=0.002)
    held = est.snapshot()["tpot_model"]["held_slow"]
    assert held == {"attacker": RESID_WINDOW}  # bounded


def test_a_slowdown_two_tenants_see_is_learned() -> None:
    rng = random.Random(2)
    est = ReplicaEstimator()
    now = warm(est, "a", rng, 0.0)
    now = warm(est, "b", rng, now, n=5)
    verdicts = []
    for _ in range(20):
        for tenant in ("a", "b"):
            verdicts.append(est.observe_tpot(DECODING, tpot(rng, 3.0), tenant, now))
            now += 0.05
    assert STALL_BACKEND in verdicts
    assert est.predict_tpot(DECODING) > 0.04  # from 0.02, towards 0.06 (at the fit's pace)


def test_a_slowdown_the_only_tenant_there_sees_is_learned() -> None:
    rng = random.Random(3)
    est = ReplicaEstimator()
    now = warm(est, "victim", rng, 0.0)
    now = warm(est, "attacker", rng, now, n=5)
    now += STALL_WINDOW_S  # the victim has not been seen for a window
    for _ in range(20):
        assert est.observe_tpot(DECODING, tpot(rng, 3.0), "attacker", now) in (
            STALL_BACKEND, None)
        now += 0.1
    assert est.predict_tpot(DECODING) > 0.04


def test_held_slow_streams_expire_and_one_partner_releases_one() -> None:
    """Another tenant's slow stream pairs with one held stream, not the whole backlog; a held
    stream older than the window pairs with nothing."""
    rng = random.Random(4)
    est = ReplicaEstimator()
    now = warm(est, "victim", rng, 0.0)
    for _ in range(5):
        assert est.observe_tpot(DECODING, tpot(rng, 5.0), "attacker", now) == STALL_OWN
        est.observe_tpot(DECODING, tpot(rng), "victim", now)
        now += 0.1
    n = est.tpot.n
    assert est.observe_tpot(DECODING, tpot(rng, 5.0), "victim", now) == STALL_BACKEND
    assert est.tpot.n == n + 2  # its own and one of the attacker's
    assert est.snapshot()["tpot_model"]["held_slow"] == {"attacker": 4}
    now += STALL_WINDOW_S
    est.observe_tpot(DECODING, tpot(rng), "victim", now)
    assert est.snapshot()["tpot_model"]["held_slow"] == {}


def test_a_cold_fit_learns_everything() -> None:
    """Before WARM_N streams the fit is its priors (20 ms): nothing is judged slow against it."""
    est = ReplicaEstimator()
    for i in range(5):
        assert est.observe_tpot(DECODING, 0.2, "a" if i % 2 else "b", float(i)) is None
