"""Which requests may race for their first token: the class's delay ("auto": its live P95,
no earlier than twice its median), and a budget per tenant that earns a share of a hedge per
request."""
from __future__ import annotations

from gateway import config
from gateway.config import SLOTarget
from gateway.errors import OK
from gateway.exchange import Exchange
from gateway.request.hedge import AUTO_MIN_SAMPLES, Hedging
from gateway.telemetry.prometheus import Metrics

MS = 1_000_000


def policy(after: object, budget: float = 0.25) -> Hedging:
    cfg = config.parse({"auth": {"mode": "open"},
                        "backends": [{"name": "a", "base_url": "http://127.0.0.1:9/v1"}],
                        "slo_classes": [{"name": "c", "ttft_ms": 500, "tpot_ms": 50,
                                         "hedge_after_ms": after},
                                        {"name": "plain", "ttft_ms": 500, "tpot_ms": 50}],
                        "retry": {"hedge_budget": budget}}, env={})
    return Hedging(cfg, Metrics())


def request(h: Hedging, cls: str = "c", tenant: str = "t", ttft_ms: float = 0.0) -> Exchange:
    ex = Exchange("/v1/chat/completions")
    ex.stream = True
    ex.tenant_label = tenant
    c = h.classes.get(cls) or config.SLOClass(name=cls, ttft_ms=500, tpot_ms=50)
    ex.slo = SLOTarget(c, c.ttft_ms, c.tpot_ms, None)
    if ttft_ms:
        ex.t_dispatched = ex.t_sent = 1_000 * MS
        ex.t_first_token = ex.t_sent + int(ttft_ms * MS)
        ex.outcome = OK
    return ex


def test_a_fixed_delay_and_no_race_for_other_classes_or_unstreamed_requests() -> None:
    h = policy(250)
    assert h.delay_s(request(h)) == 0.25
    assert h.delay_s(request(h, "plain")) is None
    unstreamed = request(h)
    unstreamed.stream = False
    assert h.delay_s(unstreamed) is None


def test_the_budget_is_earned_per_request_and_per_tenant() -> None:
    h = policy(250, budget=0.25)
    spent = []
    for _ in range(8):
        ex = request(h)
        h.delay_s(ex)
        spent.append(h.spend(ex))
    assert spent == [False, False, False, True, False, False, False, True]
    other = request(h, tenant="u")
    h.delay_s(other)
    assert not h.spend(other)  # another tenant's budget is its own


def test_auto_waits_for_samples_then_races_at_the_p95_but_never_below_twice_the_median() -> None:
    h = policy("auto")
    assert h.delay_s(request(h)) is None
    for i in range(AUTO_MIN_SAMPLES * 2):  # 10 % slow: the P95 is a slow one
        h.finished(request(h, ttft_ms=1000 if i % 10 == 9 else 100 + i % 5))
    assert h.delay_s(request(h)) == 1.0
    h = policy("auto")
    for i in range(AUTO_MIN_SAMPLES * 2):  # tightly spread: P95 104 ms, median 102 ms
        h.finished(request(h, ttft_ms=100 + i % 5))
    assert h.delay_s(request(h)) == 0.204
