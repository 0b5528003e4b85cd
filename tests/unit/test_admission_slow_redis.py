"""The slow-Redis fallback's clock (admission/shared.py `_round_trip`), on an injected clock:
round trips above the bound go local only once they have stayed above it for
redis_slow_for_s; a fast one in between starts the wait over."""
from __future__ import annotations

import logging

from gateway.admission.shared import SharedState
from gateway.config import AdmissionConfig
from tests.support.fakeclock import FakeClock


def test_round_trips_above_the_bound_for_a_while_go_local(caplog) -> None:
    caplog.set_level(logging.WARNING, "slogate.admission")
    clock = FakeClock()
    st = SharedState(AdmissionConfig(enabled=True, redis_url="redis://127.0.0.1:9/0",
                                     redis_slow_ms=20, redis_slow_for_s=5),
                     clock=clock.seconds)
    st.state = "redis"
    st._round_trip(0.100)  # one slow round trip: the wait starts
    clock.advance(4.9)
    st._round_trip(0.100)
    assert st.state == "redis"
    for _ in range(30):  # fast ones bring the average down: the wait starts over
        st._round_trip(0.001)
    assert st._slow_since is None
    for _ in range(10):
        st._round_trip(0.100)
    clock.advance(4.99)
    st._round_trip(0.100)
    assert st.state == "redis"
    clock.advance(0.02)
    st._round_trip(0.100)
    assert st.state == "local" and st.local_reason == "slow"
    st._round_trip(0.100)  # already local: no second switch, no second line
    assert st.transitions == 1
    assert len([r for r in caplog.records if "is slow" in r.getMessage()]) == 1
