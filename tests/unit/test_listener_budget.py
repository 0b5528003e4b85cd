"""The listener's start-up checks (gateway/edge/listener.py): the descriptor budget shared by
client and upstream connections, and the listen backlog the kernel grants."""
from __future__ import annotations

import logging
import resource
from pathlib import Path

import pytest

from gateway.edge import listener


@pytest.fixture
def nofile(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """RLIMIT_NOFILE as the test sets it (soft, hard); setrlimit calls recorded, not made."""
    limit = [(1024, 4096)]
    monkeypatch.setattr(resource, "getrlimit", lambda which: limit[0])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limit.__setitem__(0, value))
    return limit


def test_a_small_pool_is_budgeted_in_full(nofile: list[tuple[int, int]]) -> None:
    assert listener.fd_budget(16384, 256) == 4096 - 256 - 128
    assert nofile[0] == (4096, 4096)  # raised to the hard limit


def test_a_pool_larger_than_half_the_limit_splits_the_descriptors_evenly(
        nofile: list[tuple[int, int]]) -> None:
    # A request holds one upstream connection at a time: a 4096-connection pool under a
    # 4096-descriptor limit leaves half of it to clients, not 16.
    assert listener.fd_budget(16384, 4096) == 4096 - (4096 - 128) // 2 - 128
    nofile[0] = (1 << 20, 1 << 20)
    assert listener.fd_budget(16384, 4096) == 16384  # room for all


def test_a_backlog_over_somaxconn_is_lowered_and_said(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "somaxconn"
    path.write_text("1024\n")
    with caplog.at_level(logging.WARNING, logger="slogate"):
        assert listener.kernel_backlog(4096, str(path)) == 1024
    assert "net.core.somaxconn = 1024" in caplog.text
    caplog.clear()
    path.write_text("4096\n")
    with caplog.at_level(logging.WARNING, logger="slogate"):
        assert listener.kernel_backlog(4096, str(path)) == 4096
        assert listener.kernel_backlog(4096, str(tmp_path / "absent")) == 4096
    assert not caplog.text
