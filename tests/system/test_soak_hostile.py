"""`make soak-hostile`, short: 20 s of the hostile soak (benchmarks/soak_hostile.py) — the
gateway as a process in front of the simulator and a hostile upstream, 20 good streams and
hostile clients at once. Every good stream byte-exact, every hostile one answered as it
should be, RSS flat and back, descriptors back (~30 s in all)."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import soak_hostile

# The heaviest load tests run one after another on one xdist worker (`--dist loadgroup`),
# so two of them never share the 2 cores and each keeps its timing margins.
pytestmark = pytest.mark.xdist_group("heavy-load")


async def test_hostile_soak_short(tmp_path: Path) -> None:
    run = await soak_hostile.soak(20.0, tmp_path, warm_s=7.0)
    print("\n" + soak_hostile.table(run))
    assert not run.failures, run.failures
    assert run.good["exact"] >= 100
    assert {k for k in run.outcomes} >= set(soak_hostile.UPSTREAM) | {
        "slowloris", "idle", "slow body", "body never sent", "oversized body",
        "oversized chunked"}  # every attack ran
