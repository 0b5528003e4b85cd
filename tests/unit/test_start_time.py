"""Unit tests, no sockets, injected clocks: a waiter's predicted start is its place in the fair
order against the slots that free (gateway/admission/start_time.py), an arrival is placed where
the fair order would put it, and the controller's feasibility check and Retry-After use that
place, not the whole queue."""
from __future__ import annotations

import asyncio
import math

import pytest

from gateway.admission.controller import MIN_HOLDS, AdmissionController, ReplicaLoad, Ticket
from gateway.admission.estimator import ReplicaEstimator
from gateway.admission.fairness import FairQueue
from gateway.admission.limits import AdaptiveLimit
from gateway.admission.reserve import (
    MAX_HELD,
    Demand,
    fair_shares,
    reserved_slots,
    slot_shares,
)
from gateway.admission.start_time import SlotPlan, Slots, minimal_ttft_s, remaining_s
from gateway.errors import GatewayError
from gateway.exchange import Exchange
from tests.support.fakeclock import FakeClock
from tests.unit.test_admission_queue import BODY, FAMILY, controller, request
from tests.unit.test_fairness import W, proven_at_8


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


# -- slots held for a class under its fair share (gateway/admission/reserve.py) ------------------

def demands(now: float, **classes: tuple[float, float, float]) -> dict[str, Demand]:
    """Each class: (arrival rate /s, weight, TTFT target s), as of `now`."""
    return {c: Demand(now, w, ttft, rate, used_s=now) for c, (rate, w, ttft) in classes.items()}


def test_fair_shares_give_a_light_class_what_it_asks_and_split_the_rest_by_weight() -> None:
    assert fair_shares({"a": 1.0, "b": 10.0, "c": 10.0}, {"a": 1, "b": 1, "c": 3}, 9.0) == \
        pytest.approx({"a": 1.0, "b": 2.0, "c": 6.0})
    assert fair_shares({"a": 1.0, "b": 0.0}, {"a": 1, "b": 1}, 8.0) == {"a": 1.0, "b": 0.0}


def test_a_loose_class_over_its_share_leaves_the_tight_class_its_deficit() -> None:
    d = demands(10.0, tight=(4.0, 1.0, 0.3), loose=(4.0, 1.0, 3.0))
    share = slot_shares(d, 8, 2.0, 10.0)  # each needs 8 slots: 4 each
    assert share == pytest.approx({"tight": 4.0, "loose": 4.0})
    in_flight = {"tight": 1, "loose": 5}
    # the tight class's deficit (3), for two of its gaps between arrivals (0.25 s)
    assert reserved_slots("loose", d, share, in_flight, 10.0) == (3, pytest.approx(0.5))
    assert reserved_slots("loose", d, share, {"tight": 0, "loose": 5}, 10.0)[0] == MAX_HELD
    assert reserved_slots("loose", d, share, {"tight": 3, "loose": 4}, 10.0)[0] == 1
    assert reserved_slots("tight", d, share, in_flight, 10.0)[0] == 0  # under its own share
    # over its share, but nothing tighter is under its own: the loose class holds nothing
    assert reserved_slots("tight", d, share, {"tight": 5, "loose": 1}, 10.0)[0] == 0


def test_a_class_under_its_share_leaves_free_slots_to_a_tighter_one_under_its_own() -> None:
    """Three classes, each short of its third of the slots: the middle one can wait for the
    next slot to free, the tightest cannot, so the middle one leaves the tightest its deficit
    (and holds nothing for the loosest, nor for one of its own target under its share)."""
    d = demands(0.0, fast=(3.0, 1.0, 0.14), mid=(3.0, 1.0, 0.7), slow=(3.0, 1.0, 2.8))
    share = slot_shares(d, 9, 2.0, 0.0)  # three each
    assert reserved_slots("mid", d, share, {"fast": 1, "mid": 2, "slow": 0}, 0.0)[0] == 2
    assert reserved_slots("fast", d, share, {"fast": 1, "mid": 0, "slow": 0}, 0.0)[0] == 0
    twin = demands(0.0, a=(3.0, 1.0, 0.28), b=(3.0, 1.0, 0.28))
    twin_share = slot_shares(twin, 6, 2.0, 0.0)
    assert reserved_slots("a", twin, twin_share, {"a": 1, "b": 0}, 0.0)[0] == 0


def test_a_class_of_the_same_target_over_its_share_leaves_one_under_its_share_a_slot() -> None:
    """One flooding class beside another of the same tight target: the fair order puts the
    other first, but its turn comes when the next slot frees, often too late for the target.
    So the flooding one leaves it its deficit free too; the tight class holds none for a
    looser one."""
    d = demands(0.0, a=(9.0, 1.0, 0.28), b=(1.8, 1.0, 0.28), tight=(1.8, 1.0, 0.14))
    share = slot_shares(d, 8, 2.2, 0.0)  # a third of the slots each
    assert share["b"] == pytest.approx(share["tight"]) == pytest.approx(8 / 3)
    assert reserved_slots("a", d, share, {"a": 6, "b": 2, "tight": 0}, 0.0)[0] == 3  # tight's
    assert reserved_slots("a", d, share, {"a": 6, "b": 0, "tight": 3}, 0.0)[0] == 3  # b's
    assert reserved_slots("a", d, share, {"a": 5, "b": 1, "tight": 2}, 0.0)[0] == 2  # both
    assert reserved_slots("a", d, share, {"a": 4, "b": 3, "tight": 3}, 0.0)[0] == 0
    assert reserved_slots("tight", d, share, {"a": 2, "b": 1, "tight": 5}, 0.0)[0] == 0


def test_a_class_that_starts_is_measured_at_its_rate_within_seconds() -> None:
    """A class whose demand begins (or resumes after a pause) is entitled to its share at
    once: its arrival rate is the decayed count over the part of the window it has been
    arriving, not over the whole window (that took RATE_TAU_S to reach the rate, and a
    flooding class took the slots meanwhile)."""
    d = Demand(0.0, 1.0, 0.28, first_s=0.0)
    for i in range(1, 9):  # 4 /s for 2 s
        d.arrive(i * 0.25, 1.0, 0.28)
    assert d.rate_at(2.0) == pytest.approx(4.0, rel=0.15)
    d.arrive(20.0, 1.0, 0.28)  # after a pause: measured afresh, over at least 2 s
    assert d.rate_at(20.0) == pytest.approx(1.0 / 5.0 / -math.expm1(-2.0 / 5.0))


def test_a_class_refused_for_something_a_slot_does_not_cure_holds_none() -> None:
    d = demands(10.0, tight=(4.0, 1.0, 0.3), loose=(4.0, 1.0, 3.0))
    d["tight"].used_s = 7.0  # arrivals, but none admitted or short of a slot for 3 s
    assert "tight" not in slot_shares(d, 8, 2.0, 10.0)


def test_a_class_that_asks_for_little_holds_little_and_nothing_once_its_demand_stops() -> None:
    d = demands(0.0, tight=(0.2, 1.0, 0.3), loose=(10.0, 1.0, 3.0))
    share = slot_shares(d, 8, 2.0, 0.0)  # the tight class needs 0.4 slots
    assert reserved_slots("loose", d, share, {"loose": 7}, 0.0)[0] == 0
    d = demands(0.0, tight=(4.0, 1.0, 0.3), loose=(4.0, 1.0, 3.0))
    d["loose"].last_s = 5.0
    later = slot_shares(d, 8, 2.0, 5.0)  # no tight arrival for 5 s
    assert "tight" not in later
    assert reserved_slots("loose", d, later, {"loose": 5}, 5.0)[0] == 0


async def loose_waiter_beside_tight_demand(
        cap: int, loose_in_flight: int, tight_arrivals: int, loose_ttft_s: float = 60.0,
        proven: int | None = None
        ) -> tuple[FakeClock, AdmissionController, ReplicaLoad, Exchange, asyncio.Task[Ticket]]:
    """`loose_in_flight` loose streams on `cap` slots (slot holds learned: 2 s), the tight
    class's recent arrivals (refused for want of a slot), and one more loose request (of
    `loose_ttft_s`), queued. With `proven`, the adaptive limit probes at `cap` above that
    level (admission/limits.py)."""
    clock = FakeClock()
    ctrl = controller(clock, cap=cap)
    load = next(iter(ctrl.loads.values()))
    load.holds, load.hold_s = 10, 2.0
    if proven is not None:
        assert load.adaptive is not None
        load.adaptive.limit, load.adaptive.cuts, load.adaptive.proven = float(cap), 1, proven
    for _ in range(loose_in_flight):
        await ctrl.admit(request(clock, "loose", 0, 60), FAMILY, BODY, None, output_tokens=10)
    tight = ctrl._demand.setdefault("tight", Demand(clock() / 1e9, 1.0, 0.5))
    for _ in range(tight_arrivals):
        tight.arrive(clock() / 1e9, 1.0, 0.5)
    tight.used_s = clock() / 1e9
    loose = request(clock, "loose", 0, loose_ttft_s)
    task = asyncio.create_task(ctrl.admit(loose, FAMILY, BODY, None, output_tokens=10))
    for _ in range(20):
        await asyncio.sleep(0)
    assert loose.admission == ("queued", "fair_wait")
    return clock, ctrl, load, loose, task


async def test_a_loose_waiter_leaves_the_last_free_slot_to_a_tight_class_under_its_share(
        ) -> None:
    """Six slots, five of them busy with loose streams; loose and tight requests both keep
    arriving. The loose request waits (the free slot is the tight class's deficit), and the
    tight one that arrives next is admitted on it at once."""
    clock, ctrl, load, loose, task = await loose_waiter_beside_tight_demand(6, 5, 8)
    assert load.in_flight == 5
    tight = request(clock, "tight", 0, ttft_s=0.5)
    ticket = await asyncio.wait_for(ctrl.admit(tight, FAMILY, BODY, None, output_tokens=10), 1)
    assert ticket.slo_class == "tight" and load.by_class == {"loose": 5, "tight": 1}
    next(t for t in load.tickets if t.slo_class == "loose").withdraw()  # a slot frees
    await ctrl._drain()
    assert not task.done()  # it is held again: the tight class is still under its share
    clock.advance(2.1)  # no tight arrival since: its demand stopped
    await ctrl._drain()
    await asyncio.wait_for(task, 1)
    assert load.by_class == {"loose": 5, "tight": 1}
    await ctrl.close()


async def test_a_slot_above_the_proven_level_is_not_a_free_slot_to_hold_for_the_tight() -> None:
    """The limit probes at 8 above the 6 slots the engine has served unqueued: a request sent
    into one of the two above waits in the engine's own queue. Five loose streams run and the
    tight class is two slots short of its share. Three slots are free, but only one below the
    proven level: the loose request waits for it too, and the tight one that arrives next is
    admitted on it instead of behind the loose one in the engine's queue."""
    clock, ctrl, load, loose, task = await loose_waiter_beside_tight_demand(8, 5, 5, proven=6)
    assert load.limit() - load.in_flight == 3 and load.unproven() == 2
    tight = request(clock, "tight", 0, ttft_s=0.5)
    ticket = await asyncio.wait_for(ctrl.admit(tight, FAMILY, BODY, None, output_tokens=10), 1)
    assert ticket.slo_class == "tight" and not ticket.probe
    assert not task.done()
    task.cancel()
    await ctrl.close()


async def test_a_held_slot_nobody_takes_is_anyones_after_two_of_the_tight_gaps() -> None:
    # 10 tight arrivals: 2 /s, gaps of 0.5 s
    clock, ctrl, _, _, task = await loose_waiter_beside_tight_demand(2, 1, 10)
    clock.advance(0.5)
    await ctrl._drain()
    assert not task.done()
    # held 1.4 s: over two gaps (the rate decays with no arrival: 2 x e^(-1.4/5) /s)
    clock.advance(0.9)
    await ctrl._drain()
    await asyncio.wait_for(task, 1)
    await ctrl.close()


async def test_a_waiter_over_its_share_near_its_deadline_leaves_the_held_slot_to_the_tight(
        ) -> None:
    """The last quarter of a waiter's budget lets it pass only from a lower priority band or
    while its class is under its share: under overload the queue of a class over its share is
    always full of waiters near their deadline, and passing they took every slot held for the
    tight class (a class weighted 3:1 got half its share, the other twice its)."""
    # tight arrivals at 1 /s: the held slot waits up to two gaps, 2 s
    clock, ctrl, load, _, task = await loose_waiter_beside_tight_demand(6, 5, 5, 2.0)
    clock.advance(1.6)  # 0.4 s of its 2 s left: the last quarter
    assert ctrl._urgent(ctrl.queue[0])
    await ctrl._drain()
    assert not task.done() and load.in_flight == 5
    clock.advance(0.5)  # the slot waited its bound: anyone's
    await ctrl._drain()
    with pytest.raises(GatewayError):  # too late now for its own target
        await asyncio.wait_for(task, 1)
    await ctrl.close()


# -- slots above the level the engine served unqueued (admission/limits.py's probe) ------------

async def test_a_probe_slot_goes_to_a_class_that_can_wait_in_the_engine_not_a_tight_one() -> None:
    """The limit came down once, to the engine's batch (2 proven); it probes at 4. A request
    sent into a probe slot waits in the engine until a running stream ends: a tight class is
    told its turn is then (here too late: 429), a loose one takes the slot, predicted to wait
    that long; and its first token, should it have queued, does not teach the TTFT fit."""
    clock = FakeClock()
    ctrl = controller(clock, cap=16)
    load = next(iter(ctrl.loads.values()))
    assert load.adaptive is not None
    load.holds = 10
    load.adaptive.limit, load.adaptive.cuts, load.adaptive.proven = 4.0, 1, 2
    running = [await ctrl.admit(request(clock, "loose", 0, 10.0), FAMILY, BODY, None,
                                output_tokens=100) for _ in range(2)]
    assert load.unproven() == 2
    first_end = remaining_s(0.0, running[0].predicted_ttft_s, 100,
                            load.est.predict_tpot(4.0))
    assert load.probe_wait_s(clock()) == pytest.approx(first_end)
    tight = request(clock, "tight", 0, ttft_s=0.5)
    with pytest.raises(GatewayError) as e:
        await ctrl.admit(tight, FAMILY, BODY, None, output_tokens=10)
    assert e.value.status == 429 and tight.predicted_wait_s == pytest.approx(first_end)
    loose = await ctrl.admit(request(clock, "loose", 0, 10.0), FAMILY, BODY, None,
                             output_tokens=100)
    assert loose.probe and loose.predicted_ttft_s >= first_end
    assert not running[0].probe
    await ctrl.close()


def test_slow_start_tickets_above_the_level_it_came_down_to_do_not_teach_the_ttft_fit() -> None:
    """Sent in slow start above the level the limit came down to, a level since served
    unqueued: the first token may have queued in the engine, too briefly to be judged slow.
    When the levels below were slow too (the engine slowed), it teaches as any other."""
    clock = FakeClock()
    ctrl = controller(clock, cap=16)
    load = next(iter(ctrl.loads.values()))
    adaptive = load.adaptive
    assert adaptive is not None
    tickets = [Ticket(ctrl, load, 100.0, 400, 1.0, 0.05, False) for _ in range(10)]
    assert all(t.slow_start for t in tickets)
    adaptive.limit, adaptive.cuts, adaptive.proven = 8.0, 1, 8
    assert [t.overshot() for t in tickets] == [False] * 8 + [True] * 2
    # The 9th waited less than a slow sample's margin, the 10th did not: the limit came down
    # to 9 with 8 proven, and the 10th's first token (0.5-0.9 s on the simulator) must not
    # teach either (taught, the fit's error refused every request of a 280 ms class for 34 s)
    adaptive.limit = 9.0
    assert [t.overshot() for t in tickets] == [False] * 9 + [True]
    adaptive.limit, adaptive.proven = 8.0, 3  # slow at 4 as well: the engine slowed
    assert not any(t.overshot() for t in tickets)
    after = Ticket(ctrl, load, 100.0, 400, 1.0, 0.05, False)  # sent after the cut
    adaptive.proven = 8
    assert not after.slow_start and not after.overshot()


def test_a_probe_that_waited_in_the_engine_at_all_does_not_teach_the_ttft_fit() -> None:
    """A probe whose first token waited for a running stream to end, less than a slow sample's
    margin: not slow (the limit is not cut), but its wait must not teach the fit either (its
    residual padded every request of its tenant, and a tight class was refused for 20 s).
    A probe on time teaches; so does a request as late at a proven level (the engine's own
    speed). What is ahead of it in prefill is not a wait."""
    clock = FakeClock()
    ctrl = controller(clock, cap=16)
    load = next(iter(ctrl.loads.values()))
    adaptive = load.adaptive
    assert adaptive is not None
    adaptive.limit, adaptive.cuts, adaptive.proven = 4.0, 1, 2
    for _ in range(5):
        adaptive.sample(0.0, 1)  # a baseline: no wait beyond prefill
    theta = load.est.ttft.theta

    def first_token_after(wait_s: float, tokens: float = 100.0) -> Ticket:
        ticket = Ticket(ctrl, load, tokens, 400, 1.0, 0.05, False)
        w = ticket.work_at_dispatch / 1000.0
        t0 = clock()
        clock.advance(theta[0] + (theta[1] + theta[2] * ticket.decoding_at_dispatch) * w
                      + wait_s)
        ticket.first_token()
        assert clock() > t0
        return ticket

    at_proven = first_token_after(0.15)
    long_prompt = Ticket(ctrl, load, 2000.0, 8000, 1.0, 0.5, False)  # still prefilling
    assert not at_proven.probe and not at_proven.engine_queued
    probe_on_time = first_token_after(0.01)  # 2000 tokens ahead of it: not its wait
    assert probe_on_time.probe and not probe_on_time.engine_queued
    late_probe = first_token_after(0.15)
    assert late_probe.probe and late_probe.engine_queued
    assert adaptive.value == 4  # not slow: the limit stays
    assert long_prompt.state == "prefill"


def test_fair_shares_are_of_the_slots_the_engine_serves_unqueued_not_of_a_probing_limit() -> None:
    """A limit probing above the level the engine has served unqueued (10 on a batch-8
    engine, proven 8) lends the classes' fair shares none of its probe slots: counted over
    them, a flooding class's share grew with each probe, it read as under its share while it
    held six of the eight, and it took the slots held for another class of its target (in the
    fairness matrix's flood cell that class ran at half its share in flight)."""
    clock = FakeClock()
    ctrl = controller(clock, cap=256)
    replica = ctrl.router.replicas[0]
    load = ctrl.load_of(replica)
    load.adaptive = proven_at_8()
    assert (load.limit(), load.served_slots()) == (10, 8)
    load.decoding = 6
    load.by_class.update({"flood": 5, "other": 1})
    assert load.unproven() == 2  # 10 - max(6 in flight, 8 served)
    load.hold_s, load.holds = 2.0, MIN_HOLDS
    now = clock() / 1e9
    ctrl._demand = {  # flood asks 5 /s x 2 s = 10 slots, other 1.5 /s = 3
        "flood": Demand(last_s=now, weight=1.0, ttft_s=0.28, rate=5.0, first_s=now - 60,
                        used_s=now),
        "other": Demand(last_s=now, weight=1.0, ttft_s=0.28, rate=1.5, first_s=now - 60,
                        used_s=now)}
    share, in_flight = ctrl._slot_shares([load])
    assert sum(share.values()) == pytest.approx(8.0)
    assert share["other"] == pytest.approx(3.0, rel=0.05)
    assert share["flood"] == pytest.approx(5.0, rel=0.05)  # over it with 5: it holds for other
    assert reserved_slots("flood", ctrl._demand, share, in_flight, now)[0] == 2
    # Counted over the probing limit (10), flood's share would be 7 and its 5 under it: it
    # would leave nothing to a class of its own target.
    wide = slot_shares(ctrl._demand, load.limit(), load.hold_s, now)
    assert reserved_slots("flood", ctrl._demand, wide, in_flight, now)[0] == 0
    # Without an adaptive limit, or before it has come down, every slot of the limit counts.
    load.adaptive = AdaptiveLimit(initial=10, min_limit=2, max_limit=256)
    assert load.adaptive.cuts == 0 and load.served_slots() == load.limit() == 10
    load.adaptive = None
    assert load.served_slots() == load.limit() == 256 and load.unproven() == 0
