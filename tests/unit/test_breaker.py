"""The replica circuit breaker on a fake clock: when it opens, how long it stays open, and that
after the cooldown exactly one request probes the replica, however many arrive at once."""
from __future__ import annotations

import asyncio

from gateway.config import BreakerPolicy
from gateway.upstream.health import CLOSED, HALF_OPEN, OPEN, Breaker
from tests.support.fakeclock import FakeClock


def breaker(clock: FakeClock, failures: int = 3,
            cooldown_s: float = 10.0) -> tuple[Breaker, list[int]]:
    changes: list[int] = []
    return Breaker(BreakerPolicy(failures=failures, cooldown_s=cooldown_s), changes.append,
                   clock=clock.seconds), changes


async def acquire_all(b: Breaker, n: int) -> list[bool]:
    """n requests that reach the breaker at the same moment, each in its own task."""
    go = asyncio.Event()

    async def one() -> bool:
        await go.wait()
        return b.acquire()

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    await asyncio.sleep(0)  # every task is now waiting at the gate
    go.set()
    return await asyncio.gather(*tasks)


def test_opens_after_n_consecutive_failures_only() -> None:
    clock = FakeClock()
    b, changes = breaker(clock, failures=3)
    b.failure()
    b.failure()
    b.success()  # consecutive: a success starts the count again
    b.failure()
    b.failure()
    assert b.state == CLOSED and b.acquire() and b.available()
    b.failure()
    assert b.state == OPEN and changes == [OPEN]
    assert not b.acquire() and not b.available()


def test_stays_open_for_exactly_the_cooldown() -> None:
    clock = FakeClock()
    b, changes = breaker(clock, failures=1, cooldown_s=10.0)
    b.failure()
    assert b.retry_after_s() == 10.0
    clock.advance(4.0)
    assert b.retry_after_s() == 6.0
    clock.advance(5.999)
    assert not b.available() and not b.acquire() and b.state == OPEN
    clock.advance(0.001)
    assert b.available()  # a probe could go now (asking does not claim it)...
    assert b.state == OPEN
    assert b.acquire()  # ...and this request is it
    assert b.state == HALF_OPEN and changes == [OPEN, HALF_OPEN]
    assert not b.available() and not b.acquire()  # one probe at a time


async def test_half_open_grants_exactly_one_probe_to_concurrent_requests() -> None:
    clock = FakeClock()
    b, _ = breaker(clock, failures=1, cooldown_s=10.0)
    b.failure()
    clock.advance(10.0)
    granted = await acquire_all(b, 50)
    assert granted.count(True) == 1
    assert b.state == HALF_OPEN
    clock.advance(60)  # however long the probe takes, nobody else gets through meanwhile
    assert (await acquire_all(b, 50)).count(True) == 0


async def test_probe_success_closes_the_breaker() -> None:
    clock = FakeClock()
    b, changes = breaker(clock, failures=2, cooldown_s=10.0)
    b.failure()
    b.failure()
    clock.advance(10.0)
    assert (await acquire_all(b, 20)).count(True) == 1
    b.success()
    assert b.state == CLOSED and changes == [OPEN, HALF_OPEN, CLOSED]
    assert all(await acquire_all(b, 20))
    b.failure()  # the failure count started again from zero
    assert b.state == CLOSED


async def test_probe_failure_reopens_for_a_full_cooldown() -> None:
    clock = FakeClock()
    b, changes = breaker(clock, failures=3, cooldown_s=10.0)
    for _ in range(3):
        b.failure()
    clock.advance(12.0)
    assert (await acquire_all(b, 20)).count(True) == 1
    clock.advance(1.0)
    b.failure()  # the probe failed: one failure is enough in half-open
    assert b.state == OPEN and changes == [OPEN, HALF_OPEN, OPEN]
    assert b.retry_after_s() == 10.0  # counted from the probe's failure, not the first opening
    clock.advance(9.999)
    assert (await acquire_all(b, 20)).count(True) == 0
    clock.advance(0.001)
    assert (await acquire_all(b, 20)).count(True) == 1


async def test_a_probe_that_says_nothing_hands_the_trial_to_the_next_request() -> None:
    clock = FakeClock()
    b, _ = breaker(clock, failures=1, cooldown_s=10.0)
    b.failure()
    clock.advance(10.0)
    assert b.acquire() and not b.acquire()
    b.release()  # the probe was rate-limited, or its client left: no verdict on the replica
    assert b.state == HALF_OPEN and (await acquire_all(b, 20)).count(True) == 1
