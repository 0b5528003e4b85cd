"""Preemption's rules (admission/preemption.py) and the controller's resume lane on a fake
clock: who may take a running stream's slot from whom, which stream may pause, and that a
preempted stream gets the next slot to free before any queued request."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, strategies as st

from gateway.admission.controller import AdmissionController, Ticket
from gateway.admission.preemption import (
    MARGIN,
    PAUSE_MARGIN,
    ClassUsage,
    Running,
    Streaming,
    may_pause,
    may_take,
    slack_s,
)
from gateway.config import AdmissionConfig, SLOClass, SLOTarget
from gateway.errors import GatewayError
from gateway.exchange import Exchange
from gateway.telemetry.prometheus import Metrics
from tests.support.fakeclock import FakeClock
from tests.support.waiting import wait_until

S = 1_000_000_000
EQUAL = {"a": 1.0, "b": 1.0}


def test_usage_is_the_time_average_of_slots_in_flight() -> None:
    u = ClassUsage(tau_s=10.0)
    u.change("a", 1, 0.0)
    u.change("a", 1, 0.0)
    assert u.mean("a", 0.0) == 0.0  # nothing held yet
    assert u.mean("a", 10.0) == pytest.approx(2 * (1 - math.exp(-1)))
    assert u.mean("a", 1000.0) == pytest.approx(2.0)
    u.change("a", -2, 1000.0)
    assert u.mean("a", 1010.0) == pytest.approx(2 * math.exp(-1))
    assert u.mean("never", 5.0) == 0.0


@given(st.lists(st.tuples(st.floats(0, 30), st.sampled_from([1, -1])), max_size=40))
def test_usage_stays_between_zero_and_the_most_ever_held(steps: list[tuple[float, int]]) -> None:
    u, t, held, most = ClassUsage(), 0.0, 0, 0
    for dt, delta in steps:
        if held + delta < 0:
            continue
        t += dt
        u.change("a", delta, t)
        held += delta
        most = max(most, held)
        assert -1e-9 <= u.mean("a", t) <= most + 1e-9


def test_a_class_asking_less_than_its_part_takes_from_one_asking_more() -> None:
    share = {"a": 4.6, "b": 3.4}  # b is sated (its need), a gets the rest
    assert may_take("b", "a", share, EQUAL, {"b": 2.5, "a": 4.0})
    # never the other way, though the flood reads as under its share (slots held for b)
    assert not may_take("a", "b", share, EQUAL, {"b": 3.4, "a": 3.6})
    # a taker at its share on average is not owed a slot
    assert not may_take("b", "a", share, EQUAL, {"b": 3.4 * (1 - MARGIN), "a": 4.0})
    assert not may_take("b", "b", share, EQUAL, {"b": 0.0})


def test_between_classes_entitled_alike_the_less_served_takes() -> None:
    share = {"a": 4.0, "b": 4.0}
    assert may_take("b", "a", share, EQUAL, {"b": 2.7, "a": 4.7})
    assert not may_take("a", "b", share, EQUAL, {"b": 2.7, "a": 4.7})
    assert not may_take("b", "a", share, EQUAL, {"b": 3.6, "a": 3.7})  # within the margin


def test_weights_decide_the_entitlement() -> None:
    # b weighted 3: its 4 slots are less per unit of weight than a's 4 at weight 1
    assert may_take("b", "a", {"a": 4.0, "b": 4.0}, {"a": 1.0, "b": 3.0}, {"b": 2.0, "a": 5.0})
    assert not may_take("a", "b", {"a": 4.0, "b": 4.0}, {"a": 1.0, "b": 3.0},
                        {"b": 5.0, "a": 2.0})


def test_a_class_without_demand_gives_any_slot_and_one_without_a_share_takes_none() -> None:
    assert may_take("b", "gone", {"b": 2.0}, EQUAL, {"b": 0.5, "gone": 1.0})
    assert not may_take("new", "a", {"a": 8.0}, EQUAL, {"a": 8.0})


def test_slack_is_the_decode_time_the_target_allows_less_what_ran_and_what_is_left() -> None:
    r = Running(decoded_s=0.5, tokens=25, out_tokens=101, tpot_target_s=0.04, tpot_s=0.02)
    assert slack_s(r) == pytest.approx(0.04 * 100 - 0.5 - 76 * 0.02)


def test_a_stream_pauses_only_when_its_slack_covers_the_pause_and_it_would_not_end_in_time(
        ) -> None:
    r = Running(decoded_s=0.5, tokens=25, out_tokens=101, tpot_target_s=0.04, tpot_s=0.02)
    slack = slack_s(r)
    assert may_pause(r, slack / PAUSE_MARGIN - 0.01, needed_by_s=0.2)
    assert not may_pause(r, slack / PAUSE_MARGIN + 0.01, needed_by_s=0.2)
    # its 76 tokens left end in 1.52 s: an arrival that can wait that long needs no slot
    assert not may_pause(r, 0.01, needed_by_s=1.6)
    # nor when its first-token deadline would end the wait first
    assert not may_pause(Running(0.5, 25, 101, 0.04, 0.02, max_pause_s=0.1), 0.1, 0.2)
    # past its expected length (max_tokens unknown, longer than the mean): nothing to gain
    assert not may_pause(Running(2.0, 120, 101, 0.04, 0.02), 0.01, needed_by_s=0.0)


# -- the resume lane, on the real controller ---------------------------------------------------

class FakeReplica:
    def __init__(self) -> None:
        self.name = "r1"
        self.cfg = SimpleNamespace(max_concurrency=1, base_url="http://127.0.0.1:9",
                                   continuation="prefill")
        self.session = None

    def available(self, tenant: str | None = None) -> bool:
        return True


class FakeRouter:
    def __init__(self) -> None:
        self.replicas = [FakeReplica()]

    def replicas_for(self, model: str, family: str) -> list[FakeReplica]:
        return self.replicas


def request(clock: FakeClock, name: str, ttft_s: float = 60.0) -> Exchange:
    ctx = Exchange("/v1/chat/completions")
    ctx.t_received = clock()
    ctx.model = ctx.model_label = "m"
    cls = SLOClass(name=name, ttft_ms=ttft_s * 1e3, tpot_ms=1000.0)
    ctx.slo = SLOTarget(cls, cls.ttft_ms, cls.tpot_ms, None)
    return ctx


async def test_a_preempted_stream_gets_the_next_free_slot_before_the_queue() -> None:
    clock = FakeClock()
    router: Any = FakeRouter()
    ctrl = AdmissionController(AdmissionConfig(enabled=True, adaptive_concurrency=False),
                               router, Metrics(), clock=clock)
    victim_ctx, holder_ctx, queued_ctx = (request(clock, c) for c in ("a", "b", "a"))
    victim = await ctrl.admit(victim_ctx, "openai", 400, None)
    victim_ctx.ticket = victim
    victim.first_token()
    victim.give_up()  # preempted: its slot goes to the holder
    holder = Ticket(ctrl, victim.load, 100.0, 400, 1.0, 0.1, False, "m", slo_class="b")
    assert victim.load.in_flight == 1
    waiting = asyncio.create_task(ctrl.admit(queued_ctx, "openai", 400, None))
    await wait_until(lambda: queued_ctx.admission, 1, what="the request queued")
    assert queued_ctx.admission[0] == "queued"
    victim_ctx.token_events = 30
    resumed = asyncio.create_task(ctrl.resume(victim_ctx, "openai"))
    await wait_until(lambda: ctrl.resuming, 1, what="the stream waiting to go on")
    await ctrl._drain()
    assert not resumed.done()  # the one slot is the holder's
    holder.finish(holder_ctx)
    await ctrl._drain()
    ticket = await asyncio.wait_for(resumed, 1)
    assert ticket.resumed and ticket.replica is router.replicas[0]
    assert ticket.tokens == victim.tokens + 30  # its prompt and its answer so far
    assert not waiting.done()  # the queued request waits for the next one
    assert victim.state == "done" and victim.reservation is None
    ticket.finish(victim_ctx)
    await ctrl._drain()
    assert (await asyncio.wait_for(waiting, 1)).slo_class == "a"
    await ctrl.close()


class FakeStream:
    """What the proxy's PreemptibleStream tells admission, and whether it was cut."""

    def __init__(self, t_first: int, tokens: int) -> None:
        self.t_first, self.tokens = t_first, tokens
        self.cut = False

    def streaming(self) -> Streaming | None:
        return None if self.cut else Streaming(self.t_first, self.tokens, 60.0)

    def preempt(self) -> None:
        self.cut = True


async def flooded(clock: FakeClock) -> tuple[AdmissionController, list[Ticket],
                                           list[FakeStream]]:
    """Both slots of a replica held by streams of class a, decoding: a long prompt with the
    longer answer (the more slack), then a short one; how long a slot is held and the
    engine's speed (20 ms a token) learned."""
    router: Any = FakeRouter()
    router.replicas[0].cfg.max_concurrency = 2
    ctrl = AdmissionController(AdmissionConfig(enabled=True, adaptive_concurrency=False),
                               router, Metrics(), clock=clock)
    tickets, hooks = [], []
    for body, out in ((8000, 300), (400, 200)):
        ticket = await ctrl.admit(request(clock, "a"), "openai", body, None, output_tokens=out)
        ticket.first_token()
        hooks.append(FakeStream(clock(), 20))
        ticket.preemptible = hooks[-1]
        tickets.append(ticket)
    load = tickets[0].load
    load.holds, load.hold_s = 10, 3.0
    for _ in range(20):
        load.est.observe_tpot(2.0, 0.02)
    clock.advance(0.5)
    return ctrl, tickets, hooks


async def test_the_arrival_takes_the_slot_of_the_stream_cheapest_to_continue() -> None:
    clock = FakeClock()
    ctrl, tickets, hooks = await flooded(clock)
    load = tickets[0].load
    b = request(clock, "b", ttft_s=0.5)
    ticket = await asyncio.wait_for(ctrl.admit(b, "openai", 400, None, output_tokens=300), 5)
    assert b.admission == ("admitted", "preempted")
    assert [h.cut for h in hooks] == [False, True]  # the short prompt's stream
    assert [t.state for t in tickets] == ["decode", "preempted"]
    assert ticket.load is load and load.in_flight == 2 and ticket.slo_class == "b"
    ticket.first_token()
    ticket.preemptible = FakeStream(clock(), 1)
    # the flooding class's arrival takes nothing back from b: it is refused
    with pytest.raises(GatewayError, match="ttft_infeasible"):
        await asyncio.wait_for(ctrl.admit(request(clock, "a", ttft_s=0.5), "openai", 400,
                                          None, output_tokens=10), 5)
    assert not hooks[0].cut
    await ctrl.close()


async def test_no_preemption_where_a_request_waits_in_the_engine_for_the_slot() -> None:
    """A request queued in the engine (reported by its metrics, or sent above the level it
    serves unqueued) would take the slot a preempted stream frees, not the arrival."""
    clock = FakeClock()
    ctrl, tickets, hooks = await flooded(clock)
    tickets[0].load.engine_waiting = 1.0
    with pytest.raises(GatewayError, match="ttft_infeasible"):
        await asyncio.wait_for(ctrl.admit(request(clock, "b", ttft_s=0.5), "openai", 400,
                                          None, output_tokens=300), 5)
    assert not any(h.cut for h in hooks)
    await ctrl.close()


async def test_a_waiter_whose_turn_keeps_slipping_preempts_before_its_deadline() -> None:
    """A stream running past its predicted end is predicted to free its slot a token later,
    again and again: the waiter counting on it takes a running stream's slot once less than
    a quarter of its TTFT target is left beyond its own prefill, not after its deadline."""
    clock = FakeClock()
    router: Any = FakeRouter()
    router.replicas[0].cfg.max_concurrency = 2
    ctrl = AdmissionController(AdmissionConfig(enabled=True, adaptive_concurrency=False),
                               router, Metrics(), clock=clock)
    hooks = []
    for out in (10, 300):  # one due to end (it overruns), one with far to go
        ticket = await ctrl.admit(request(clock, "a"), "openai", 400, None, output_tokens=out)
        ticket.first_token()
        hooks.append(FakeStream(clock(), 5))
        ticket.preemptible = hooks[-1]
    load = ticket.load
    load.holds, load.hold_s = 10, 3.0
    for _ in range(20):
        load.est.observe_tpot(2.0, 0.02)
    clock.advance(1.0)  # the 10-token stream should have ended: it frees "a token from now"
    b = request(clock, "b", ttft_s=0.5)
    waiting = asyncio.create_task(ctrl.admit(b, "openai", 400, None, output_tokens=300))
    await wait_until(lambda: b.admission, 1, what="the request queued")
    assert b.admission[0] == "queued" and not any(h.cut for h in hooks)
    await ctrl._drain()
    assert not waiting.done()  # 0.5 s to go: it may still come
    clock.advance(0.35)
    await ctrl._drain()
    ticket = await asyncio.wait_for(waiting, 1)
    assert b.admission == ("admitted", "preempted")
    assert [h.cut for h in hooks] == [False, True]  # the one with far to go
    await ctrl.close()
