"""Unit tests, no sockets, injected clocks: a waiter's predicted start is its place in the fair
order against the slots that free (gateway/admission/start_time.py), an arrival is placed where
the fair order would put it, and the controller's feasibility check and Retry-After use that
place, not the whole queue."""
from __future__ import annotations

import asyncio
import math

import pytest

from gateway.admission.estimator import ReplicaEstimator
from gateway.admission.fairness import FairQueue
from gateway.admission.start_time import SlotPlan, Slots, minimal_ttft_s, remaining_s
from gateway.errors import GatewayError
from gateway.exchange import Exchange
from tests.support.fakeclock import FakeClock
from tests.unit.test_admission_queue import BODY, FAMILY, controller, request
from tests.unit.test_fairness import W


def test_a_stream_frees_its_slot_after_its_predicted_decode_and_never_before_one_token() -> None:
    assert remaining_s(0.5, 0.1, 101, 0.01) == pytest.approx(0.6)  # 0.1 + 100 x 0.01 - 0.5
    assert remaining_s(9.0, 0.1, 101, 0.01) == 0.01  # ran long: still one more token


def test_waiters_take_the_earliest_slot_in_order_and_hold_it_for_their_own_decode() -> None:
    plan = SlotPlan([Slots(free=1, releases=[0.3, 0.1], first_token_s=0.05, tpot_s=0.01)])
    assert plan.take(11) == 0.0  # a free slot now; it holds it 0.05 + 10 x 0.01 = 0.15 s
    assert plan.take(11) == pytest.approx(0.1)
    assert plan.take(11) == pytest.approx(0.15)  # the first waiter's slot, freed again
    assert plan.take(11) == pytest.approx(0.25)
    assert plan.take(11) == pytest.approx(0.3)
    assert SlotPlan([]).take(10) == math.inf and SlotPlan([]).peek() == math.inf


def test_waiters_starting_together_prefill_together() -> None:
    plan = SlotPlan([Slots(free=2, releases=[1.0], first_token_s=0.05, tpot_s=0.01)])
    a = plan.take(100, 300.0)
    b = plan.take(100, 200.0)
    assert a == b == 0.0 and plan.prefilling_with(b, 0.05) == 500.0
    c = plan.take(100, 100.0)
    assert c == 1.0 and plan.prefilling_with(c, 0.05) == 100.0  # the first two are long done


def test_the_minimal_ttft_is_an_idle_prefill_plus_one_decode_step() -> None:
    est = ReplicaEstimator()
    assert minimal_ttft_s(est, 1000.0) == pytest.approx(
        est.predict_ttft(1000.0, 0.0, 0.0) + est.predict_tpot(1.0))


def test_an_arrival_under_its_share_is_placed_near_the_head_without_changing_the_queue() -> None:
    q = FairQueue()
    hogs = [W(("t", "batch"), deadline=100 + i, name=f"b{i}") for i in range(5)]
    for w in hogs:
        q.push(w, 1.0, 0.0)
    for w in hogs[:3]:  # batch was dispatched: its tag moved on
        q.dispatched(w)
    more = [W(("t", "batch"), deadline=200 + i, name=f"c{i}") for i in range(5)]
    for w in more:
        q.push(w, 1.0, 0.0)
    new = W(("t", "interactive"), deadline=10_000, name="new")
    order = [w.name for w in q.order(new, 1.0, 0.0)]
    assert order.index("new") <= 1  # not behind the 7 batch waiters
    assert "new" not in [w.name for w in q.order()] and len(q) == 7  # nothing pushed


async def test_an_arrival_waits_for_the_slots_of_those_ahead_of_it_in_fair_order_only() -> None:
    """A replica with one slot, held by a stream whose end is predicted; the queue holds many
    waiters of one flow. An arrival of another flow goes to the head: it is predicted to start
    when that one slot frees, and is admitted to the queue, however long the queue is."""
    clock = FakeClock()
    ctrl = controller(clock, cap=1)
    load = next(iter(ctrl.loads.values()))
    load.holds = 10  # slot releases are predicted from here on
    holder = await ctrl.admit(request(clock, "x", 0, 60), FAMILY, BODY, None, output_tokens=10)
    hogs = [asyncio.create_task(ctrl.admit(request(clock, "batch", 0, 60), FAMILY, BODY, None,
                                           output_tokens=10)) for _ in range(20)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(ctrl.queue) == 20
    ctx = request(clock, "interactive", 0, ttft_s=1.0)
    task = asyncio.create_task(ctrl.admit(ctx, FAMILY, BODY, None, output_tokens=10))
    for _ in range(20):
        await asyncio.sleep(0)
    assert ctx.admission == ("queued", "fair_wait"), ctx.admission
    tpot = load.est.predict_tpot(1.0)
    expected = remaining_s(0.0, holder.predicted_ttft_s, 10, tpot)
    assert ctx.predicted_wait_s == pytest.approx(expected)  # the holder's end, not 20 waiters'
    holder.finish(Exchange("/v1/chat/completions"))
    await ctrl._drain()
    ticket = await asyncio.wait_for(task, 1)  # its turn came first
    assert ticket.predicted_wait_s == pytest.approx(expected)
    for t in hogs:
        t.cancel()
    await ctrl.close()


async def test_an_arrival_whose_turn_comes_too_late_is_refused_with_that_turn_as_retry_after(
        ) -> None:
    clock = FakeClock()
    ctrl = controller(clock, cap=1)
    next(iter(ctrl.loads.values())).holds = 10
    await ctrl.admit(request(clock, "x", 0, 60), FAMILY, BODY, None, output_tokens=400)
    ctx = request(clock, "interactive", 0, ttft_s=0.5)
    with pytest.raises(GatewayError) as e:
        await ctrl.admit(ctx, FAMILY, BODY, None, output_tokens=10)
    assert e.value.status == 429 and "ttft_infeasible" in str(e.value.args)
    wait = ctx.predicted_wait_s
    assert wait is not None and wait > 2.0  # 400 tokens of decode ahead of it
    assert e.value.headers["Retry-After"] == str(math.ceil(wait))
    await ctrl.close()


async def test_a_target_below_the_idle_ttft_is_refused_as_unreachable() -> None:
    clock = FakeClock()
    ctrl = controller(clock, cap=1)
    await ctrl.admit(request(clock, "x", 0, 60), FAMILY, BODY, None)
    ctx = request(clock, "impossible", 0, ttft_s=0.001)
    with pytest.raises(GatewayError) as e:
        await ctrl.admit(ctx, FAMILY, BODY, None)
    message = str(e.value.args[0])
    assert e.value.status == 429 and "even when idle" in message and "ttft_ms" in message
    await ctrl.close()
