"""Exploration on a fake clock: a request the TTFT model says misses its target even on a
free slot is sent anyway, once per EXPLORE_INTERVAL_S per replica, while the prediction is
within EXPLORE_RATIO of its budget; others are refused as before. A refused request teaches
the model nothing, so a per-token cost learned too steep would otherwise refuse every long
prompt for as long as it lasted."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.admission.controller import EXPLORE_INTERVAL_S, AdmissionController
from gateway.config import AdmissionConfig, SLOClass, SLOTarget
from gateway.errors import GatewayError
from gateway.exchange import Exchange
from gateway.telemetry.prometheus import Metrics
from tests.support.fakeclock import FakeClock

LONG = 8000  # bytes: ~2,000 prompt tokens


class FakeReplica:
    def __init__(self) -> None:
        self.name = "r1"
        self.cfg = SimpleNamespace(max_concurrency=4, base_url="http://127.0.0.1:9",
                                   continuation="")
        self.session = None

    def available(self, tenant: str | None = None) -> bool:
        return True


class FakeRouter:
    def __init__(self) -> None:
        self.replicas = [FakeReplica()]

    def replicas_for(self, model: str, family: str) -> list[FakeReplica]:
        return self.replicas


def request(clock: FakeClock, ttft_s: float) -> Exchange:
    ctx = Exchange("/v1/chat/completions")
    ctx.t_received = clock()
    ctx.model = ctx.model_label = "m"
    cls = SLOClass(name="c", ttft_ms=ttft_s * 1e3, tpot_ms=1000.0)
    ctx.slo = SLOTarget(cls, cls.ttft_ms, cls.tpot_ms, None)
    return ctx


async def test_a_request_refused_by_the_model_alone_is_sent_now_and_then() -> None:
    clock = FakeClock()
    router: Any = FakeRouter()
    ctrl = AdmissionController(AdmissionConfig(enabled=True, adaptive_concurrency=False),
                               router, Metrics(), clock=clock)
    busy = await ctrl.admit(request(clock, 60.0), "openai", 400, None)  # not idle: no probe
    load = busy.load
    load.holds, load.hold_s = 10, 1.0
    for i in range(40):  # a model that says 0.5 s per 1,000 prompt tokens
        tokens = 100.0 + 50 * (i % 40)
        load.est.observe_ttft(tokens, 0.0, 0.0, 0.02 + tokens * 5e-4, "t", clock.seconds())
    predicted = load.est.predict_ttft(2000.0, 1.0, 0.0)
    assert 0.8 < predicted < 1.4
    explored = request(clock, 0.5)
    ticket = await ctrl.admit(explored, "openai", LONG, None)
    assert explored.admission == ("admitted", "explore") and ticket.load is load
    with pytest.raises(GatewayError, match="ttft_infeasible"):  # one per interval
        await ctrl.admit(request(clock, 0.5), "openai", LONG, None)
    ticket.finish(explored)  # (its prompt no longer ahead of the next)
    clock.advance(EXPLORE_INTERVAL_S)
    with pytest.raises(GatewayError, match="ttft_infeasible"):  # hopeless even if 4x off
        await ctrl.admit(request(clock, 0.2), "openai", LONG, None)
    again = request(clock, 0.5)
    await ctrl.admit(again, "openai", LONG, None)
    assert again.admission == ("admitted", "explore")
    await ctrl.close()
