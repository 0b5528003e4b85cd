"""Admission's overload lines: one when it starts refusing, one when it has stopped (a request
admitted after a quiet spell), on an injected clock."""
from __future__ import annotations

import logging

import pytest

from gateway.admission.shed_log import SHEDDING_STARTED, SHEDDING_STOPPED, ShedLog


def test_one_line_when_shedding_starts_and_one_when_it_stops(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "slogate.admission")
    now = [100.0]
    shed = ShedLog(clock=lambda: now[0], quiet_s=10.0)
    shed.admitted()  # nothing to say
    for i in range(50):
        now[0] += 0.1
        shed.refused("queue_full" if i % 5 else "ttft_infeasible")
        shed.admitted()  # admitted in between, but not after a quiet spell: still shedding
    now[0] += 9.0
    shed.admitted()
    assert [r.event for r in caplog.records] == [SHEDDING_STARTED]  # type: ignore[attr-defined]
    now[0] += 1.0
    shed.admitted()
    shed.admitted()
    records = caplog.records
    assert [r.event for r in records] == [SHEDDING_STARTED,  # type: ignore[attr-defined]
                                          SHEDDING_STOPPED]
    assert records[0].getMessage() == "admission started refusing requests: ttft_infeasible"
    assert records[1].getMessage() == ("admission stopped refusing requests: 50 refused in "
                                       "4.9 s (40 queue_full, 10 ttft_infeasible)")
    shed.refused("queue_full")  # a new episode
    assert len(caplog.records) == 3
