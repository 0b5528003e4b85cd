"""Unit tests, no sockets, injected clocks: the weighted fair queue's order (the README's worked
example), min_share under strict priority, who is shed when the queue is full; the adaptive
concurrency limit; the robust per-tenant calibration; quota buckets."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from gateway.admission.estimator import TokenCalibration
from gateway.admission.fairness import FairQueue
from gateway.admission.limits import AdaptiveLimit
from gateway.admission.quotas import Bucket, TenantQuotas
from gateway.config import Quotas, TenantPolicy
from gateway.errors import RateLimited
from tests.support.fakeclock import FakeClock

_seq = itertools.count()


@dataclass(eq=False)
class W:
    flow: tuple[str, str]
    deadline: int
    priority: int = 0
    seq: int = field(default_factory=lambda: next(_seq))
    name: str = ""


def drain(q: FairQueue, n: int) -> list[str]:
    """Dispatch the next n in fair order, one at a time (as the controller does)."""
    out = []
    for _ in range(n):
        w = next(q.order())
        q.dispatched(w)
        out.append(w.name)
    return out


def test_worked_example_weights_two_to_one_and_edf_inside_a_flow() -> None:
    """README's example: tenant A (weight 2) and B (weight 1), both backlogged; A's requests
    go in deadline order, not arrival order."""
    q = FairQueue()
    for deadline in (30, 10, 20, 40):
        q.push(W(("A", "std"), deadline, name=f"A{deadline}"), weight=2.0, min_share=0.0)
    for i in range(3):
        q.push(W(("B", "std"), 5 + i, name=f"B{i}"), weight=1.0, min_share=0.0)
    assert [w.name for w in q.order()] == ["B0", "A10", "A20", "B1", "A30", "A40", "B2"]
    assert drain(q, 7) == ["B0", "A10", "A20", "B1", "A30", "A40", "B2"]


def test_an_idle_flow_banks_no_credit() -> None:
    q = FairQueue()
    for i in range(6):
        q.push(W(("A", "c"), i, name=f"A{i}"), 1.0, 0.0)
    assert drain(q, 4) == ["A0", "A1", "A2", "A3"]
    # B arrives late: it is not owed the 4 dispatches it did not ask for.
    for i in range(3):
        q.push(W(("B", "c"), 100 + i, name=f"B{i}"), 1.0, 0.0)
    assert drain(q, 4) == ["B0", "A4", "B1", "A5"]  # alternating from now on


def test_strict_priority_keeps_min_share_for_the_lower_class() -> None:
    q = FairQueue()
    for i in range(200):
        q.push(W(("t", "high"), i, priority=10, name="high"), 1.0, 0.05)
        q.push(W(("t", "low"), i, priority=0, name="low"), 1.0, 0.2)
    got = drain(q, 100)
    assert got[:10] == ["high"] * 10  # strict priority first
    assert 0.17 <= got.count("low") / 100 <= 0.25, got.count("low")


def test_the_flow_over_its_share_is_shed() -> None:
    q = FairQueue()
    for i in range(10):
        q.push(W(("flood", "c"), i, name=f"f{i}"), 1.0, 0.0)
    q.push(W(("quiet", "c"), 0, name="q0"), 1.0, 0.0)
    victim = q.victim(("quiet", "c"), 1.0)
    assert victim is not None and victim.name == "f9"  # the flood's newest
    assert q.victim(("flood", "c"), 1.0) is None  # the flood's own arrival is the one shed


def test_adaptive_limit_grows_while_fast_and_backs_off_on_engine_queueing() -> None:
    lim = AdaptiveLimit(initial=4, min_limit=2, max_limit=256)
    for _ in range(300):  # fast but hardly used: a history, and no growth
        lim.sample(0.02, in_flight=1)
    assert lim.value == 4
    for _ in range(20):  # fast, and the limit is in use: grows (slow start: +1 per sample)
        lim.sample(0.02, in_flight=lim.value)
    grown = lim.value
    assert grown == 24
    for _ in range(100):  # the engine queues: TTFT jumps by seconds
        lim.sample(2.0, in_flight=lim.value)
    assert lim.value < grown / 2 and lim.cuts > 0
    before = lim.value
    for _ in range(8 * before):  # after a decrease: about +1 every two rounds
        lim.sample(0.02, in_flight=lim.value)
    assert before + 2 <= lim.value <= before + 5
    idle = AdaptiveLimit(initial=8, min_limit=2, max_limit=256)
    for _ in range(400):  # fast but hardly used: no evidence the engine takes more
        idle.sample(0.02, in_flight=1)
    assert idle.value == 8
    capped = AdaptiveLimit(initial=8, min_limit=2, max_limit=10)
    for _ in range(400):
        capped.sample(0.02, in_flight=capped.value)
    assert capped.value == 10  # max_concurrency bounds it
    capped.engine_reports(6.0)  # the engine says its batch is 6
    assert capped.value == 6


def test_slow_start_overshooting_the_batch_is_judged_from_its_first_samples() -> None:
    """Slow start climbs one per sample; the first tokens queued behind a full batch of 8 come
    later, a third of the first samples: judged slow as they come (not averaged into a
    median that passes them), the limit comes down below the level they were sent at."""
    lim = AdaptiveLimit(initial=8, min_limit=2, max_limit=256)
    for _ in range(4):
        lim.sample(0.02, in_flight=lim.value)
    assert lim.value == 12 and lim.cuts == 0
    assert lim.sample(0.8, in_flight=10) and lim.sample(0.9, in_flight=11)
    assert lim.value <= 9 and lim.cuts > 0


def test_slow_start_overshooting_is_answered_by_the_cut_alone_not_a_backoff_below_it() -> None:
    """The first tokens that queued behind a full batch of 8 in slow start bring the limit
    down to the batch: they are answered by that cut, and the round they end does not back
    off below it (a level the engine had served: x 0.85 took a batch-8 engine to 6)."""
    lim = AdaptiveLimit(initial=4, min_limit=2, max_limit=256)
    while lim.value < 10:  # slow start: +1 per sample while the limit is in use
        lim.sample(0.02, in_flight=min(8, lim.value))
    assert lim.cuts == 0
    for n in (9, 10, 10, 9):
        assert lim.sample(0.6, in_flight=n)
    for _ in range(8):
        lim.sample(0.02, in_flight=8)
    assert lim.value == 8 and lim.proven == 8, lim.snapshot()


def proven_at_8() -> AdaptiveLimit:
    """A limit whose slow start overshot a batch-8 engine, then served 8 unqueued."""
    lim = AdaptiveLimit(initial=8, min_limit=2, max_limit=256)
    for _ in range(4):
        lim.sample(0.02, in_flight=8)
    assert lim.sample(0.9, in_flight=9)  # slow start's first overshoot: proven 8
    for _ in range(40):
        lim.sample(0.02, in_flight=8)
    return lim


def test_a_level_is_proven_by_unqueued_samples_not_by_short_engine_queueing() -> None:
    """Above the proven level a request waits in the engine until a running stream ends:
    often less than the slow threshold (floor 250 ms). Such first tokens are not slow, but
    they are not proof that the engine takes one more either: only samples near the
    unqueued ones are."""
    lim = proven_at_8()
    assert lim.proven == 8
    for _ in range(6):  # queued 150-200 ms behind the batch: not slow, no proof
        assert not lim.sample(0.18, in_flight=9)
    assert lim.proven == 8 and lim.probe(9)
    for _ in range(3):
        lim.sample(0.03, in_flight=9)
    assert lim.proven == 9
    # proven by luck after all: one that queued longer comes back to 8, and the round it
    # ends in backs off no further (x 0.85 took it to 6, under the batch)
    lim.limit = 9.0
    assert lim.sample(0.9, in_flight=9) and lim.value == 8
    for _ in range(8):
        lim.sample(0.02, in_flight=8)
    assert lim.value == 8 and lim.proven == 8, lim.snapshot()


def test_a_level_is_proven_by_unqueued_samples_in_a_row_not_by_lucky_ones_among_waits() -> None:
    """Above a batch-8 engine a probe waits for a running stream to end: about one in six
    ends within the clean margin and looks unqueued. Three of them among probes that waited
    are streams ending just in time, not a 9th slot: each wait ends the row."""
    lim = proven_at_8()
    for _ in range(4):
        lim.sample(0.03, in_flight=9)  # lucky: a stream ended as it came
        for wait in (0.12, 0.18, 0.09, 0.15, 0.2):
            assert not lim.sample(wait, in_flight=9)  # waited, not slow
    assert lim.proven == 8 and lim.probe(9)
    for _ in range(3):
        lim.sample(0.03, in_flight=9)
    assert lim.proven == 9


def test_slow_start_proves_a_level_only_with_a_first_token_that_did_not_wait() -> None:
    """In slow start every level is tried; one whose first token waited for a running
    stream to end, less than a slow sample's margin, was not served unqueued."""
    lim = AdaptiveLimit(initial=8, min_limit=2, max_limit=256)
    for _ in range(4):
        lim.sample(0.02, in_flight=8)
    assert lim.proven == 8
    assert not lim.sample(0.15, in_flight=9) and lim.cuts == 0
    assert lim.proven == 8
    lim.sample(0.03, in_flight=9)
    assert lim.proven == 9


def test_a_probe_above_the_proven_level_is_answered_by_one_step_down_not_a_backoff() -> None:
    """Once the limit has come down, the level the engine served unqueued is known; a
    dispatch above it is a probe. One that queued brings the limit back to the proven level,
    and no multiplicative backoff below it (that took the limit under the batch after every
    probe); a slow sample at a proven level (the engine slowed) still backs off."""
    lim = AdaptiveLimit(initial=8, min_limit=2, max_limit=256)
    for _ in range(4):
        lim.sample(0.02, in_flight=8)
    assert lim.sample(0.9, in_flight=9)  # slow start's first overshoot
    assert lim.value == 8 and lim.cuts == 1
    for _ in range(20):
        lim.sample(0.02, in_flight=8)
    assert lim.proven == 8 and lim.probe(9) and not lim.probe(8)
    probing = lim.value
    assert probing == 9  # +1 every two rounds: it probes again
    for _ in range(3):  # rounds with one slow probe each: never below the batch
        assert lim.sample(0.9, in_flight=9)
        for _ in range(7):
            lim.sample(0.02, in_flight=8)
        assert lim.value == 8, lim.snapshot()
    lim.sample(0.02, in_flight=9)  # a probe that did not queue: luck, or the engine takes 9
    assert lim.proven == 8
    lim.sample(0.02, in_flight=9)
    lim.sample(0.02, in_flight=9)  # three in a row: the engine takes 9
    assert lim.proven == 9 and not lim.probe(9)
    for _ in range(8):  # slow at a proven level: the engine slowed, and the limit backs off
        lim.sample(0.9, in_flight=8)
    assert lim.value < 8


def test_calibration_is_per_tenant_robust_and_bounded() -> None:
    cal = TokenCalibration()
    for _ in range(8):
        cal.observe("victim", 1000, 250)
    for _ in range(30):
        cal.observe("attacker", 1_000_000, 250)  # 1 MB of padding, the same 250 tokens
    assert cal.ratio("victim") == pytest.approx(0.25)
    assert cal.ratio("attacker") == pytest.approx(0.005)  # clamped at the lower bound
    cal.observe("victim", 1000, 1)  # one odd prompt moves nothing
    assert cal.ratio("victim") == pytest.approx(0.25)
    assert cal.ratio("newcomer") == pytest.approx((0.25 + 0.005) / 2)  # one vote per tenant


def test_bucket_refills_at_its_rate() -> None:
    clock = FakeClock()
    b = Bucket(60, clock.seconds)
    assert all(b.take(1)[0] for _ in range(60))
    assert b.take(1) == (False, 0.0)
    clock.advance(1.0)
    assert b.take(1)[0]


async def test_quotas_refuse_with_limits_and_give_back_what_a_shed_request_took() -> None:
    clock = FakeClock()
    quotas = TenantQuotas(clock=clock.seconds)
    policy = TenantPolicy(quotas=Quotas(requests_per_minute=2, tokens_per_minute=1000))
    a = await quotas.reserve("t", policy, 300)
    b = await quotas.reserve("t", policy, 300)
    with pytest.raises(RateLimited) as e:
        await quotas.reserve("t", policy, 300)
    assert e.value.code == "quota_requests_per_minute"
    assert e.value.limits.requests_limit == 2 and e.value.limits.requests_remaining == 0
    assert e.value.headers["Retry-After"] == "30"  # one request back after 30 s
    quotas.give_back(b)  # shed by admission: the request and its tokens come back
    c = await quotas.reserve("t", policy, 300)
    quotas.finished(a, used_tokens=900)  # it used more than reserved: the bucket pays
    quotas.finished(c, used_tokens=10)
    with pytest.raises(RateLimited) as e:
        await quotas.reserve("t", policy, 300)
    assert e.value.code == "quota_requests_per_minute"
