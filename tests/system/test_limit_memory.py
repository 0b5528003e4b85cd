"""Memory after upstream limit hits: the gateway as a process (benchmarks/soak_hostile.py's
stack: the simulator, the hostile upstream, the gateway with 1 MiB limits and the breaker off)
takes 1,000 limit hits — oversized non-streamed answers, gzip bombs, unterminated SSE lines,
huge events before and after the first token, mixed — and its RSS comes back within 10 MiB of
what it was after a warm-up of the same (measured: +0.6 to +2.2 MiB, peak +7).

It also guards gateway/ops/server.py's collector thresholds: with them, a reference cycle on
the request path is never collected (a 1 MiB cycle per limit hit: +1,005 MiB here)."""
from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import aiohttp
import pytest

from benchmarks import soak_hostile
from benchmarks.procstat import rss_mib

# The heaviest load tests run one after another on one xdist worker (`--dist loadgroup`),
# so two of them never share the 2 cores and each keeps its timing margins.
pytestmark = pytest.mark.xdist_group("heavy-load")

# one upstream limit hit per request, except those retried before the first token (two)
MIX = ("flood-json", "bomb", "flood-line", "huge-event", "flood-after", "flood-prefirst")


async def limit_hits(st: soak_hostile.Stack, n: int, concurrency: int = 8) -> int:
    """Requests from MIX, `concurrency` at a time, until the gateway counted `n` limit hits
    more than before; returns how many it counted."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as probe:
        start = (await soak_hostile.gauges(probe, st.url))["limit_hits"]
        models = itertools.cycle(MIX)
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def one(model: str) -> str:
                async with sem:
                    return await soak_hostile.upstream_request(s, st.url, model)

            hits = 0.0
            while hits < n:
                # requests left, at most two hits each: never many more than n in all
                batch = max(1, min(concurrency * 4, int(n - hits) // 2))
                got = await asyncio.gather(*[one(next(models)) for _ in range(batch)])
                assert all(g.split()[1].endswith("_too_large") for g in got), got
                hits = (await soak_hostile.gauges(probe, st.url))["limit_hits"] - start
        return int(hits)


async def test_rss_after_1000_limit_hits_returns_within_10_mib(tmp_path: Path) -> None:
    async with soak_hostile.stack(tmp_path / "logs") as st:
        assert await limit_hits(st, 200) >= 200  # warm-up: every path once and more
        await soak_hostile.settle(st, 1 << 30, timeout=10)
        await asyncio.sleep(0.5)
        base = rss_mib(st.pid)
        peak = base
        sampling = True

        async def sample() -> None:
            nonlocal peak
            while sampling:
                peak = max(peak, rss_mib(st.pid))
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        t0 = time.monotonic()
        hits = await limit_hits(st, 1000)
        elapsed = time.monotonic() - t0
        sampling = False
        await sampler
        await soak_hostile.settle(st, 1 << 30, timeout=10)
        deadline = time.monotonic() + 10
        while (end := rss_mib(st.pid)) > base + 10 and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        print(f"\n{hits} limit hits in {elapsed:.1f} s: RSS after warm-up {base:.1f} MiB, "
              f"peak {peak:.1f} MiB, after {end:.1f} MiB ({end - base:+.1f})")
        assert hits >= 1000
        assert end - base <= 10, (base, peak, end)
        assert "Traceback" not in st.log_text()
