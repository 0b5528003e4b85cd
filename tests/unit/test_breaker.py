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


# -- tenants: a backend is judged only by what says something about the backend --------------

def tenant_breaker(clock: FakeClock, failures: int = 3, cooldown_s: float = 10.0
                   ) -> tuple[Breaker, list[str]]:
    held: list[str] = []
    return Breaker(BreakerPolicy(failures=failures, cooldown_s=cooldown_s), lambda state: None,
                   clock=clock.seconds, on_hold=held.append), held


def test_one_tenants_failures_open_it_on_that_tenants_word_only() -> None:
    clock = FakeClock()
    b, held = tenant_breaker(clock)
    b.success("victim")
    for _ in range(3):  # the attacker's burst: nobody else's outcome in between
        b.failure("status 500", "attacker")
    assert b.state == OPEN and b.opened_by == "attacker"
    assert not b.acquire("attacker") and not b.available(tenant="attacker")
    assert not b.available()  # the replica as a whole: open
    assert b.acquire("victim") and b.acquire("bystander")  # others' requests still go there
    assert not b.probing_for("victim")  # ... as ordinary requests, not as the probe
    b.success("victim")  # and the first of them decides: the failures were the attacker's
    assert b.state == CLOSED and held == ["attacker"]
    assert b.held("attacker") and not b.acquire("attacker")
    assert all(b.acquire("victim") for _ in range(5))
    assert b.retry_after_s("attacker") == 10.0
    assert b.why_unavailable("attacker").startswith(
        "held off for this tenant for another 10 s: its last 3 requests there failed while "
        "other tenants' succeeded; last failure ")


def test_a_tenant_that_fails_between_others_successes_is_held_and_the_replica_stays_closed(
        ) -> None:
    clock = FakeClock()
    b, held = tenant_breaker(clock)
    for _ in range(3):
        b.success("victim")
        b.failure("status 500", "attacker")
    assert b.state == CLOSED and held == ["attacker"]
    assert b.acquire("victim") and not b.acquire("attacker")
    clock.advance(9.999)
    assert not b.acquire("attacker")
    clock.advance(0.001)
    assert b.acquire("attacker") and b.probing_for("attacker")  # its hold's one probe
    assert not b.acquire("attacker")
    b.failure("status 500", "attacker")  # still failing: held for another full cooldown
    assert b.state == CLOSED and b.retry_after_s("attacker") == 10.0
    assert not b.acquire("attacker") and b.acquire("victim")
    clock.advance(10.0)
    assert b.acquire("attacker")
    b.release("attacker")  # its probe said nothing (it left): the next one probes
    assert b.acquire("attacker")
    b.success("attacker")
    assert not b.held("attacker") and b.acquire("attacker") and b.acquire("attacker")


def test_a_second_tenant_failing_opens_it_for_everyone() -> None:
    clock = FakeClock()
    b, held = tenant_breaker(clock, cooldown_s=10.0)
    for _ in range(3):
        b.failure("status 500", "a")
    clock.advance(4.0)
    assert b.opened_by == "a" and b.acquire("b")
    b.failure("status 500", "b")  # b sees it fail too: it is the backend
    assert b.state == OPEN and b.opened_by is None and held == []
    assert not b.acquire("b") and not b.acquire("c") and not b.acquire("a")
    assert b.retry_after_s("c") == 10.0  # a full cooldown from the confirmation
    clock.advance(10.0)
    assert b.acquire("c") and not b.acquire("b")  # then one probe, whoever's
    b.success("c")
    assert b.state == CLOSED and held == [] and b.acquire("a") and b.acquire("b")


def test_failures_from_two_tenants_open_it_for_everyone_at_once() -> None:
    clock = FakeClock()
    b, _ = tenant_breaker(clock)
    b.failure("refused", "a")
    b.failure("refused", "b")
    assert b.state == CLOSED
    b.failure("refused", "a")
    assert b.state == OPEN and b.opened_by is None
    assert not b.acquire("a") and not b.acquire("b") and not b.acquire("c")


def test_a_genuine_outage_with_one_tenant_is_the_classic_breaker() -> None:
    """Open mode (every request is tenant `other`), or one tenant using the replica alone:
    its failures open the circuit, a probe after the cooldown decides."""
    clock = FakeClock()
    b, held = tenant_breaker(clock, cooldown_s=5.0)
    for _ in range(3):
        b.failure("refused", "other")
    assert b.state == OPEN and not b.acquire("other") and not b.available()
    assert b.why_unavailable().startswith("circuit open for another 5 s after 3 failures; ")
    clock.advance(5.0)
    assert b.acquire("other") and not b.acquire("other")
    b.failure("refused", "other")  # the probe failed: open again
    assert b.state == OPEN and held == []
    clock.advance(5.0)
    assert b.acquire("other")
    b.success("other")
    assert b.state == CLOSED and held == []


def test_a_one_tenant_outage_opens_for_everyone_once_another_tenant_sees_it() -> None:
    """Only `a` uses the replica when it dies: a is refused on its own word; the first
    request of `b` that fails too makes it the backend's for everyone."""
    clock = FakeClock()
    b, _ = tenant_breaker(clock)
    for _ in range(3):
        b.failure("refused", "a")
    clock.advance(30.0)  # long after the cooldown, a probes and fails again
    assert b.acquire("a")
    b.failure("refused", "a")
    assert b.opened_by == "a" and b.acquire("b")
    b.failure("refused", "b")
    assert b.opened_by is None and not b.acquire("b")
    assert "all one tenant's" not in b.why_unavailable()
