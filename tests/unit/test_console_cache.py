"""The console's snapshot is computed at most once per STATE_MAX_AGE_S, on an injected clock,
and the Host allow-list's parsing (gateway/edge/hosts.py)."""
from __future__ import annotations

from gateway.console.recorder import ConsoleRecorder
from gateway.console.web import STATE_MAX_AGE_S, Console
from gateway.edge.hosts import HostAllowList
from gateway.request.slo import SLOClass
from tests.support.fakeclock import FakeClock


def test_snapshot_is_cached_for_its_max_age() -> None:
    clock = FakeClock()
    rec = ConsoleRecorder([SLOClass("default", 1000, 100)])
    console = Console(rec, lambda: None, "v", clock=clock.seconds)
    calls = 0
    snapshot = console.snapshot

    def counted():  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return snapshot()

    console.snapshot = counted  # type: ignore[method-assign]
    first = console.snapshot_bytes()
    for _ in range(1000):
        assert console.snapshot_bytes() is first
    assert calls == 1
    clock.advance(STATE_MAX_AGE_S * 0.99)
    assert console.snapshot_bytes() is first and calls == 1
    clock.advance(STATE_MAX_AGE_S * 0.02)
    console.snapshot_bytes()
    assert calls == 2


def test_host_allow_list() -> None:
    hosts = HostAllowList(["0.0.0.0", "GW.internal."])
    for ok in ("127.0.0.1", "127.0.0.1:80", "[::1]:8080", "::1", "localhost", "a.localhost:1",
               "gw.internal", "gw.internal:8080", "192.168.1.7:8080", None):
        assert hosts.allows(ok), ok
    for bad in ("evil.example", "localhost.evil.example", "gw.internal.evil", "",
                "127.0.0.1.nip.io"):
        assert not hosts.allows(bad), bad
    assert HostAllowList(["*"]).allows("evil.example")
