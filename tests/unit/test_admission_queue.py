"""The admission queue on a fake clock, against one replica whose capacity the test frees by
hand: who is admitted next (priority, then earliest deadline), and the last-chance rule that
lets a lower-priority request near its deadline pass a more important one that cannot go yet.

The replica and router are stand-ins (only what the controller reads); the controller, its
tickets, estimators and metrics are the real ones.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.admission.controller import AdmissionController, Ticket
from gateway.config import AdmissionConfig, SLOClass, SLOTarget
from gateway.errors import GatewayError
from gateway.exchange import Exchange
from gateway.telemetry.prometheus import Metrics
from tests.support.fakeclock import FakeClock
from tests.support.waiting import wait_until

S = 1_000_000_000
FAMILY = "openai"
BODY = 400  # bytes: ~100 prompt tokens, ~0.07 s predicted TTFT on a fresh estimator


class FakeReplica:
    def __init__(self, name: str, cap: int) -> None:
        self.name = name
        self.cfg = SimpleNamespace(max_concurrency=cap, base_url="http://127.0.0.1:9")
        self.session = None

    def available(self, tenant: str | None = None) -> bool:
        return True


class FakeRouter:
    def __init__(self, replicas: list[FakeReplica]) -> None:
        self.replicas = replicas

    def replicas_for(self, model: str, family: str) -> list[FakeReplica]:
        return self.replicas


def controller(clock: FakeClock, cap: int = 1) -> AdmissionController:
    router: Any = FakeRouter([FakeReplica("r1", cap)])
    return AdmissionController(AdmissionConfig(enabled=True), router, Metrics(), clock=clock)


def request(clock: FakeClock, name: str, priority: int, ttft_s: float,
            tpot_s: float = 1.0) -> Exchange:
    ctx = Exchange("/v1/chat/completions")
    ctx.t_received = clock()
    ctx.model = ctx.model_label = "m"
    cls = SLOClass(name=name, ttft_ms=ttft_s * 1e3, tpot_ms=tpot_s * 1e3, priority=priority)
    ctx.slo = SLOTarget(cls, cls.ttft_ms, cls.tpot_ms, None)
    return ctx


async def queued(ctrl: AdmissionController, ctx: Exchange) -> asyncio.Task[Ticket]:
    """admit() in a task, returned once the request is waiting in the queue."""
    task = asyncio.create_task(ctrl.admit(ctx, FAMILY, BODY, None))
    for _ in range(100):
        await asyncio.sleep(0)
        if ctx.admission is not None:
            break
    assert ctx.admission is not None and ctx.admission[0] == "queued", ctx.admission
    return task


async def admitted_next(ctrl: AdmissionController, tasks: dict[str, asyncio.Task[Ticket]],
                        ) -> list[str]:
    """Run one pass of the queue; the names of the requests it admitted."""
    await ctrl._drain()
    for _ in range(5):
        await asyncio.sleep(0)  # let the admitted requests' admit() calls return
    return sorted(n for n, t in tasks.items() if t.done())


async def test_queue_admits_by_priority_then_earliest_deadline() -> None:
    clock = FakeClock()
    ctrl = controller(clock, cap=1)
    holder = await ctrl.admit(request(clock, "x", 0, 60), FAMILY, BODY, None)  # fills the cap
    tasks: dict[str, asyncio.Task[Ticket]] = {}
    # arrival order is deliberately not the admission order
    for name, priority, ttft_s in (("low-late", 0, 60), ("high-late", 10, 50),
                                   ("low-early", 0, 30), ("high-early", 10, 20)):
        tasks[name] = await queued(ctrl, request(clock, name, priority, ttft_s))
        clock.advance(0.01)
    assert await admitted_next(ctrl, tasks) == []  # the replica is still full
    order = []
    ticket = holder
    while len(order) < 4:
        ticket.finish(Exchange("/v1/chat/completions"))  # capacity frees for one
        done = [n for n in await admitted_next(ctrl, tasks) if n not in order]
        assert len(done) == 1, done  # the cap lets exactly one through each time
        order.append(done[0])
        ticket = tasks[done[0]].result()
    assert order == ["high-early", "high-late", "low-early", "low-late"]
    await ctrl.close()


async def test_last_chance_lets_a_lower_priority_request_pass_near_its_deadline() -> None:
    clock = FakeClock()
    ctrl = controller(clock, cap=4)
    holder = await ctrl.admit(request(clock, "x", 0, 60), FAMILY, BODY, None)
    holder.first_token()  # one stream decoding: a 1 ms TPOT target cannot be met now
    # The important one waits for its TPOT (not for capacity); it blocks its band and below.
    strict_ctx = request(clock, "strict", 10, ttft_s=60, tpot_s=0.001)
    strict = await queued(ctrl, strict_ctx)
    assert strict_ctx.admission == ("queued", "tpot_wait")
    lax_ctx = request(clock, "lax", 0, ttft_s=10)
    lax = await queued(ctrl, lax_ctx)
    assert lax_ctx.admission == ("queued", "priority_wait")
    tasks = {"strict": strict, "lax": lax}
    clock.advance(7.4)  # 2.6 s of its 10 s budget left: not yet the last quarter
    assert await admitted_next(ctrl, tasks) == []
    clock.advance(0.2)  # 2.4 s left (< 25 %): its last chance comes before the other's next
    assert await admitted_next(ctrl, tasks) == ["lax"]
    assert lax.result().load.in_flight == 2  # admitted beside the holder, on free capacity
    assert not strict.done() and len(ctrl.queue) == 1
    strict.cancel()
    await ctrl.close()


async def test_a_request_whose_deadline_cannot_be_met_is_rejected_from_the_queue() -> None:
    clock = FakeClock()
    ctrl = controller(clock, cap=1)
    await ctrl.admit(request(clock, "x", 0, 60), FAMILY, BODY, None)
    task = await queued(ctrl, request(clock, "short", 0, ttft_s=1.0))
    clock.advance(0.95)  # 50 ms left; even an idle replica needs ~70 ms
    await ctrl._drain()
    with pytest.raises(GatewayError) as e:
        await asyncio.wait_for(task, 1)
    assert e.value.status == 429 and "ttft_infeasible" in str(e.value.args)
    await ctrl.close()


async def test_ticket_records_decoding_at_first_token_for_the_tpot_estimate() -> None:
    """Regression: `decoding_sum` was set only in first_token() (read back with getattr)."""
    clock = FakeClock()
    ctrl = controller(clock, cap=8)
    others = [await ctrl.admit(request(clock, "x", 0, 60), FAMILY, BODY, None) for _ in range(3)]
    ticket = await ctrl.admit(request(clock, "x", 0, 60), FAMILY, BODY, None)
    assert ticket.decoding_sum is None  # an attribute from the start, not only after a token
    others[0].first_token()
    ticket.first_token()
    assert ticket.decoding_sum == 2  # itself and the one stream decoding before it
    for t in others[1:]:
        t.first_token()
    observed: list[tuple[float, float]] = []
    def observe(decoding: float, s: float, tenant: str, now: float) -> None:
        observed.append((decoding, s))
    ticket.load.est.observe_tpot = observe  # type: ignore[method-assign,assignment]
    ctx = request(clock, "x", 0, 60)
    ctx.outcome, ctx.stream, ctx.completion_tokens = "ok", True, 11
    ctx.t_sent = clock()
    ctx.t_first_token = ctx.t_sent + S // 10
    ctx.t_last_token = ctx.t_first_token + S  # 10 tokens after the first in 1 s
    ticket.finish(ctx)  # 4 decoding when it ends
    assert observed == [(3.0, pytest.approx(0.1))]  # the mean of 2 and 4 streams, 0.1 s/token


async def test_close_cancels_a_queue_drain_in_progress() -> None:
    """Regression: the drain task was started with ensure_future and no reference, so close()
    could not stop it (and the loop could collect it mid-run)."""
    clock = FakeClock()
    gate = asyncio.Event()  # a global slot that never frees: the drain waits on it

    class SharedState:
        def remote_prefill_tokens(self, name: str) -> float:
            return 0.0

        async def try_acquire(self, name: str, cap: int) -> bool:
            await gate.wait()
            return True

    router: Any = FakeRouter([FakeReplica("r1", 1)])
    ctrl = AdmissionController(AdmissionConfig(enabled=True), router, Metrics(),
                               shared=SharedState(), clock=clock)
    ctrl.loads["r1"].prefilling = 1  # full: the next request queues
    task = await queued(ctrl, request(clock, "x", 0, 60))
    ctrl.loads["r1"].prefilling = 0  # capacity frees: the drain starts and waits for a slot
    ctrl.wake()

    def draining() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if not t.done()
                and getattr(t.get_coro(), "__qualname__", "") == "AdmissionController._drain"]

    await wait_until(draining, timeout=2, what="a queue drain waiting for a global slot")
    await ctrl.close()
    # the cancellation reaches the drain through the global slot it is waiting for
    await wait_until(lambda: not draining(), timeout=2, what="the drain cancelled")
    assert not ctrl._waking  # a controller reopened later would drain again
    task.cancel()


async def test_a_first_token_race_finds_room_only_below_the_limit_and_with_nobody_waiting() -> None:
    clock = FakeClock()
    ctrl = controller(clock, cap=1)
    [replica] = ctrl.router.replicas
    assert ctrl.room_for_hedge([replica])
    holder = await ctrl.admit(request(clock, "x", 0, 60), FAMILY, BODY, None)
    assert not ctrl.room_for_hedge([replica])  # at its limit
    waiting = await queued(ctrl, request(clock, "y", 0, 60))
    holder.finish(Exchange("/v1/chat/completions"))
    assert not ctrl.room_for_hedge([replica])  # someone is waiting for admission
    await admitted_next(ctrl, {"y": waiting})
    waiting.result().finish(Exchange("/v1/chat/completions"))
    assert ctrl.room_for_hedge([replica])
    await ctrl.close()
