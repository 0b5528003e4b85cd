"""The operator's log of a backend's health, on a fake clock: one line when it starts failing,
when its circuit opens (failures, cooldown, cause) and closes, when an active check fails or
recovers; at most one line per backend and kind every 10 s, the rest told as "(N more since)";
and the breaker's own account of why a backend is unavailable."""
from __future__ import annotations

import logging

import pytest

from gateway.config import BreakerPolicy
from gateway.errors import AttemptFailed, deadline_failure
from gateway.upstream.health import Breaker
from gateway.upstream.incidents import CIRCUIT_CLOSED, CIRCUIT_OPEN, FAILING, BackendLog, Throttle
from tests.support.fakeclock import FakeClock

REFUSED = "127.0.0.1:9: connection refused"


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "slogate.health"]


def breaker(clock: FakeClock, failures: int = 3, cooldown_s: float = 5.0) -> Breaker:
    return Breaker(BreakerPolicy(failures=failures, cooldown_s=cooldown_s), lambda state: None,
                   clock.seconds, BackendLog("local", clock.seconds))


def test_an_outage_is_three_lines_with_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "slogate.health")
    clock = FakeClock()
    b = breaker(clock)
    for _ in range(3):
        b.failure(REFUSED)
        clock.advance(0.1)
    clock.advance(5.0)
    assert b.acquire()  # the probe
    b.success()
    assert lines(caplog) == [
        f"backend 'local' is failing: {REFUSED}",
        f"backend 'local' is unavailable: circuit open for 5.0 s (after 3 failures in a row; "
        f"last: {REFUSED})",
        "backend 'local' recovered: circuit closed (5.3 s after its first failure)",
    ]
    records = [r for r in caplog.records if r.name == "slogate.health"]
    assert [r.__dict__["event"] for r in records] == [FAILING, CIRCUIT_OPEN, CIRCUIT_CLOSED]
    assert {r.__dict__["backend"] for r in records} == {"local"}
    assert records[1].__dict__["detail"] == REFUSED


def test_failed_probes_are_one_line_per_10_s_with_a_count(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "slogate.health")
    clock = FakeClock()
    b = breaker(clock, failures=1, cooldown_s=2.0)
    b.failure(REFUSED)  # opens at once: no separate "is failing" line
    for _ in range(6):  # a probe every 2 s, each failing: the circuit re-opens each time
        clock.advance(2.0)
        assert b.acquire()
        b.failure("status 503")
    assert lines(caplog) == [
        f"backend 'local' is unavailable: circuit open for 2.0 s (after 1 failure; last: "
        f"{REFUSED})",
        "backend 'local' is unavailable: circuit open for 2.0 s (its probe failed; last: "
        "status 503) (4 more since)",
    ]


def test_a_failure_while_open_says_nothing_new(caplog: pytest.LogCaptureFixture) -> None:
    """Requests that were in flight when the circuit opened fail too: no second 'open' line."""
    caplog.set_level(logging.WARNING, "slogate.health")
    clock = FakeClock()
    b = breaker(clock, failures=1)
    b.failure(REFUSED)
    clock.advance(11)
    b.failure(REFUSED)
    assert len(lines(caplog)) == 1


def test_throttle_counts_what_it_held_back() -> None:
    clock = FakeClock()
    t = Throttle(10.0, clock.seconds)
    assert t.allow("a") == 0
    assert t.allow("b") == 0  # each kind has its own window
    clock.advance(9.9)
    assert t.allow("a") is None and t.allow("a") is None
    clock.advance(0.1)
    assert t.allow("a") == 2
    assert t.allow("a") is None


def test_the_breaker_says_why_a_backend_is_unavailable() -> None:
    clock = FakeClock()
    b = breaker(clock, failures=5, cooldown_s=10.0)
    assert b.why_unavailable() == "circuit closed"
    for _ in range(5):
        b.failure(REFUSED)
    clock.advance(5.5)
    assert b.why_unavailable() == (f"circuit open for another 5 s after 5 failures; last "
                                   f"failure 5.5 s ago: {REFUSED}")
    clock.advance(5.0)
    assert b.acquire()
    assert b.why_unavailable().startswith("circuit half-open: one request is testing")


@pytest.mark.parametrize(("failure", "words"), [
    (AttemptFailed("connect_error", 502, "Backend 'x' is unreachable: 10.0.0.5:8000: timed "
                   "out.", "upstream_unreachable", cause="10.0.0.5:8000: timed out"),
     "10.0.0.5:8000: timed out"),
    (AttemptFailed("http_503", 503, "Upstream answered 503.", "upstream_503"), "status 503"),
    (deadline_failure("first_token_timeout"), "no first token before the deadline"),
    (AttemptFailed("closed_before_first_token", 502, "The upstream closed the stream before "
                   "the first token.", "upstream_stream_truncated"),
     "closed the stream before the first token"),
    (AttemptFailed("event_too_large", 502, "The upstream sent an event of more than 10 bytes "
                   "(11 so far).", "event_too_large"),
     "The upstream sent an event of more than 10 bytes (11 so far)"),
])
def test_an_attempt_failure_in_words(failure: AttemptFailed, words: str) -> None:
    assert failure.cause == words


def test_one_tenants_failures_are_told_as_that_tenants(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "slogate.health")
    clock = FakeClock()
    b = breaker(clock)
    b.success("victim")
    for _ in range(3):
        b.failure("status 500", "attacker")
    assert b.acquire("victim")
    b.success("victim")
    assert lines(caplog) == [
        "backend 'local' is failing: status 500",
        "backend 'local' is unavailable: circuit open for 5.0 s (after 3 failures in a row, all "
        "tenant 'attacker''s: other tenants' requests still go there; last: status 500)",
        "backend 'local' fails tenant 'attacker' only: its requests are held off for 5.0 s, "
        "other tenants' still go there (3 failures in a row while another tenant's request "
        "succeeded; last: status 500)",
    ]
