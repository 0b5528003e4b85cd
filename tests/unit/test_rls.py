"""The TTFT fit's recursive least squares: coefficients that are costs never go negative,
whatever the observations (hypothesis)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gateway.admission.estimator import ReplicaEstimator

# (prompt tokens ahead, streams decoding, requests ahead, seconds), as engines report them
OBSERVATION = st.tuples(st.floats(0, 8000), st.floats(0, 16), st.floats(0, 8),
                        st.floats(0, 3))


@settings(max_examples=200, deadline=None)
@given(st.lists(OBSERVATION, min_size=1, max_size=60))
def test_a_cost_per_token_stream_or_request_ahead_never_goes_below_zero(
        observations: list[tuple[float, float, float, float]]) -> None:
    """Projecting one coefficient onto zero moves the correlated ones with it, and can push
    another below zero: each stays >= 0 after every observation."""
    est = ReplicaEstimator()
    for work, decoding, ahead, seconds in observations:
        est.ttft.update(est._ttft_x(work, decoding, ahead), seconds)
        assert all(est.ttft.theta[i] >= 0.0 for i in est.ttft.nonneg), est.ttft.theta

