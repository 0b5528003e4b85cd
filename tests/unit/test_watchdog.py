"""The request Watchdog on a fake clock: each deadline fires at its exact instant, never before.

The watchdog is given the fake clock and the fake clock's timers (`loop=`), so a test moves
time by hand; the request is a task that waits until the watchdog cancels it, then claims the
reason, as the proxy does.
"""
from __future__ import annotations

import asyncio

from gateway.exchange import Exchange
from gateway.request.deadlines import FIRST_TOKEN, IDLE, SHUTDOWN, TOTAL, Watchdog
from tests.support.fakeclock import FakeClock

S = 1_000_000_000  # ns per second


class Request:
    """A request task guarded by a Watchdog on `clock`; `outcome()` is what its handler saw."""

    def __init__(self, clock: FakeClock, total_s: float, idle_s: float) -> None:
        self.clock = clock
        self.ctx = Exchange("/v1/chat/completions")
        self.ctx.t_received = clock()
        self.total_s, self.idle_s = total_s, idle_s
        self.watchdog: Watchdog | None = None
        self.task: asyncio.Task[tuple[str | None, int]] | None = None

    async def start(self) -> Watchdog:
        made: asyncio.Future[Watchdog] = asyncio.get_running_loop().create_future()

        async def handler() -> tuple[str | None, int]:
            wd = Watchdog(self.ctx, self.ctx.t_received + int(self.total_s * S), self.idle_s,
                          clock=self.clock, loop=self.clock)
            made.set_result(wd)
            try:
                await asyncio.Event().wait()  # relaying, until something cancels us
            except asyncio.CancelledError:
                reason = wd.claim()
                task = asyncio.current_task()
                assert task is not None
                return reason, task.cancelling()
            raise AssertionError("unreachable")

        self.task = asyncio.create_task(handler())
        self.watchdog = await made
        return self.watchdog

    async def outcome(self) -> tuple[str | None, int]:
        assert self.task is not None
        return await asyncio.wait_for(self.task, 1)

    async def running(self) -> bool:
        await asyncio.sleep(0)  # let a cancellation, if any, be delivered
        assert self.task is not None and self.watchdog is not None
        return not self.task.done() and self.watchdog.fired is None

    def event(self, token: bool = True) -> None:
        """An upstream SSE event arrives now (the relay only stamps the context)."""
        now = self.clock()
        self.ctx.t_last_event = now
        if token and not self.ctx.t_first_token:
            self.ctx.t_first_token = now
            assert self.watchdog is not None
            self.watchdog.first_token()


async def test_first_token_deadline_fires_at_its_instant() -> None:
    clock = FakeClock()
    req = Request(clock, total_s=60, idle_s=5)
    wd = await req.start()
    wd.attempt(first_token_s=2.0, idle_s=5)
    clock.advance(1.999)
    assert await req.running()
    req.event(token=False)  # a ping or role chunk is not a token: the deadline stands
    clock.advance(0.001)
    assert wd.fired == FIRST_TOKEN
    # claim() un-cancels the task so the handler can still answer (502/504, or a retry)
    assert await req.outcome() == (FIRST_TOKEN, 0)


async def test_a_token_stamped_after_the_deadline_is_late_whatever_ran_first() -> None:
    """A loop that stalls past the deadline and the token's arrival runs the read before the
    timer: the token's stamp, after the deadline, still makes it a first-token timeout."""
    clock = FakeClock()
    req = Request(clock, total_s=60, idle_s=5)
    wd = await req.start()
    wd.attempt(first_token_s=0.001, idle_s=5)
    clock.ns += 50_000_000  # 50 ms pass with no timer run (the stalled loop)
    req.event()  # the read comes first and stamps the token at 50 ms
    assert wd.fired == FIRST_TOKEN
    assert await req.outcome() == (FIRST_TOKEN, 0)


async def test_first_token_in_time_then_idle_gap_runs_out() -> None:
    clock = FakeClock()
    req = Request(clock, total_s=60, idle_s=1.0)
    wd = await req.start()
    wd.attempt(first_token_s=2.0, idle_s=1.0)
    clock.advance(1.5)
    req.event()  # the first token, 0.5 s before its deadline
    clock.advance(0.999)  # past the first-token deadline (2.0): it no longer applies
    assert await req.running()
    clock.advance(0.001)  # 1.0 s after the last event
    assert wd.fired == IDLE
    assert await req.outcome() == (IDLE, 0)


async def test_idle_deadline_rearms_after_every_event() -> None:
    clock = FakeClock()
    req = Request(clock, total_s=60, idle_s=1.0)
    wd = await req.start()
    wd.attempt(first_token_s=5.0, idle_s=1.0)
    clock.advance(0.1)
    req.event()
    for _ in range(20):  # events 0.9 s apart: never an idle gap of 1 s
        clock.advance(0.9)
        req.event()
        assert await req.running()
    t_last = clock()
    clock.advance(0.999)
    assert await req.running()
    clock.advance(0.001)
    assert wd.fired == IDLE and clock() == t_last + S
    assert await req.outcome() == (IDLE, 0)


async def test_total_deadline_ends_a_stream_that_never_goes_idle() -> None:
    clock = FakeClock()
    req = Request(clock, total_s=3.0, idle_s=1.0)
    wd = await req.start()
    wd.attempt(first_token_s=2.0, idle_s=1.0)
    clock.advance(0.5)
    req.event()
    for _ in range(24):  # an event every 0.1 s up to 2.9 s
        clock.advance(0.1)
        req.event()
    assert await req.running()
    clock.advance(0.099)
    assert await req.running()
    clock.advance(0.001)
    assert wd.fired == TOTAL
    assert await req.outcome() == (TOTAL, 0)


async def test_first_token_deadline_is_capped_by_the_total() -> None:
    clock = FakeClock()
    req = Request(clock, total_s=3.0, idle_s=1.0)
    wd = await req.start()
    wd.attempt(first_token_s=10.0, idle_s=1.0)
    clock.advance(2.999)
    assert await req.running()
    clock.advance(0.001)
    assert wd.fired == TOTAL  # the total is due first, and says so
    assert await req.outcome() == (TOTAL, 0)


async def test_a_new_attempt_gets_its_own_first_token_deadline() -> None:
    clock = FakeClock()
    req = Request(clock, total_s=60, idle_s=1.0)
    wd = await req.start()
    wd.attempt(first_token_s=2.0, idle_s=1.0)
    clock.advance(1.5)
    wd.attempt(first_token_s=2.0, idle_s=1.0)  # a retry on another replica, 1.5 s in
    clock.advance(1.0)  # 2.5 s: past the first attempt's deadline
    assert await req.running()
    clock.advance(0.999)
    assert await req.running()
    clock.advance(0.001)  # 3.5 s: 2 s after the retry started
    assert wd.fired == FIRST_TOKEN
    assert await req.outcome() == (FIRST_TOKEN, 0)


async def test_the_attempt_after_a_first_token_timeout_is_watched_too() -> None:
    """The proxy claims a first-token timeout and fails over in the same task: the next
    attempt's deadline must fire as well (it did not once a deadline had fired)."""
    clock = FakeClock()
    ctx = Exchange("/v1/chat/completions")
    ctx.t_received = clock()
    seen: list[str | None] = []
    started = asyncio.Event()

    async def handler() -> None:
        wd = Watchdog(ctx, ctx.t_received + 60 * S, 5, clock=clock, loop=clock)
        for _ in range(2):  # two attempts, each stalled before its first token
            wd.attempt(first_token_s=1.0, idle_s=5)
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                seen.append(wd.claim())

    task = asyncio.create_task(handler())
    await started.wait()
    clock.advance(1.0)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert seen == [FIRST_TOKEN]
    clock.advance(0.999)
    await asyncio.sleep(0)
    assert seen == [FIRST_TOKEN]
    clock.advance(0.001)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert seen == [FIRST_TOKEN, FIRST_TOKEN]  # the second deadline fired by itself
    await asyncio.wait_for(task, 1)


async def test_fire_is_claimed_once_and_a_client_cancel_is_not_claimed() -> None:
    clock = FakeClock()
    req = Request(clock, total_s=60, idle_s=1.0)
    wd = await req.start()
    wd.fire(SHUTDOWN)
    wd.fire(TOTAL)  # the first reason stands
    clock.advance(100)  # the timer finds the watchdog already fired: nothing more happens
    assert wd.fired == SHUTDOWN
    assert await req.outcome() == (SHUTDOWN, 0)

    other = Request(clock, total_s=60, idle_s=1.0)
    wd2 = await other.start()
    assert other.task is not None
    other.task.cancel()  # the client went away: not the watchdog's doing
    assert await other.outcome() == (None, 1)  # not claimed, so the task stays cancelled
    wd2.fire(SHUTDOWN)  # too late: the task is done, nothing to fire at
    assert wd2.fired is None


async def test_stop_disarms_the_timer() -> None:
    clock = FakeClock()
    req = Request(clock, total_s=3.0, idle_s=1.0)
    wd = await req.start()
    wd.attempt(first_token_s=1.0, idle_s=1.0)
    wd.stop()
    assert clock.pending() == []
    clock.advance(10)
    assert await req.running()
    assert req.task is not None
    req.task.cancel()
    assert await req.outcome() == (None, 1)


async def test_one_timer_serves_a_request_whose_deadlines_only_move_later() -> None:
    """The proxy's first check is due with the first attempt's first-token deadline; the
    attempt, and a first token whose idle gap ends later, leave that timer as it is. It checks
    early, re-arms, and each deadline still fires at its own instant."""
    clock = FakeClock()
    ctx = Exchange("/v1/chat/completions")
    ctx.t_received = clock()
    fired: list[str | None] = []

    async def handler() -> None:
        wd = Watchdog(ctx, ctx.t_received + 60 * S, 3.0, first_check_s=2.0, clock=clock,
                      loop=clock)
        clock.advance(0.5)
        wd.attempt(first_token_s=2.0, idle_s=3.0)  # due at 2.5 s: the timer (2.0 s) stays
        assert [t.when for t in clock.pending()] == [ctx.t_received + 2 * S]
        clock.advance(1.0)
        ctx.t_first_token = ctx.t_last_event = clock()
        wd.first_token()  # idle gap ends at 4.5 s: still the one timer
        assert len(clock.pending()) == 1
        parked.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            fired.append(wd.claim())

    parked = asyncio.Event()
    task = asyncio.create_task(handler())
    await parked.wait()  # the handler's timer is set and it waits
    clock.advance(2.999)  # 4.499 s: the early check re-armed, nothing fired
    assert not task.cancelling() and len(clock.pending()) == 1  # a firing cancels at once
    clock.advance(0.001)
    await asyncio.wait_for(task, 1)
    assert fired == [IDLE] and clock() == ctx.t_received + 4.5 * S
