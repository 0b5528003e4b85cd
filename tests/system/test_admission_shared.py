"""Several gateway processes share admission state through a real redis-server: one global
concurrency cap per replica, enforced exactly; a killed gateway's slots come back after its
lease; Redis down -> each gateway falls back to its local share, and back when Redis returns.

Everything runs as real processes: redis-server, `slogate sim`, two `slogate serve`."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from tests.support.procs import Proc, slogate
from tests.support.redis_server import RedisServer, redis_server
from tests.support.waiting import wait_until

CAP = 4
STEP_MS = 20  # the simulator's decode step: a request of N tokens holds its slot ~N x 20 ms
RELAXED = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "60000"}  # queue rather than reject

CONFIG = """
[auth]
mode = "open"
slo_overrides = true
[server]
access_log = false
[admission]
enabled = true
redis_url = "{redis}"
lease_s = 1.0
redis_share = 0.5
[[slo_classes]]
name = "relaxed"
ttft_ms = 60000
tpot_ms = 60000
[[backends]]
name = "sim"
base_url = "{sim}/v1"
models = ["m"]
max_concurrency = {cap}
"""


class Stack:
    def __init__(self, redis: RedisServer, sim: Proc, a: Proc, b: Proc,
                 s: aiohttp.ClientSession) -> None:
        self.redis, self.sim, self.a, self.b, self.s = redis, sim, a, b, s
        self.peak = 0
        self._watch: asyncio.Task | None = None

    async def at_sim(self) -> int:
        """Requests the simulated engine holds now (running + waiting)."""
        async with self.s.get(self.sim.url + "/sim/stats") as r:
            st = await r.json()
        return st["running"] + st["waiting"]

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[Stack]:
        """Poll the simulator throughout the block; self.peak = most requests it held at once."""
        self.peak = 0
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                self.peak = max(self.peak, await self.at_sim())
                await asyncio.sleep(0.005)

        task = asyncio.create_task(watch())
        try:
            yield self
        finally:
            stop.set()
            await task

    async def stream(self, gw: Proc, max_tokens: int) -> dict:
        t0 = time.monotonic()
        body = {"model": "m", "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "hello " * 20}]}
        async with self.s.post(gw.url + "/v1/chat/completions", json=body,
                               headers=RELAXED) as r:
            out: dict = {"status": r.status, "ttft": None, "done": False}
            if r.status != 200:
                out["body"] = await r.text()
                return out
            async for line in r.content:
                if out["ttft"] is None and b'"content":"' in line and b'"content":""' not in line:
                    out["ttft"] = time.monotonic() - t0
                if line.startswith(b"data: [DONE]"):
                    out["done"] = True
            return out

    async def shared(self, gw: Proc) -> dict:
        async with self.s.get(gw.url + "/admin/admission") as r:
            return (await r.json())["shared"]

    async def gauge(self, gw: Proc) -> dict[str, float]:
        async with self.s.get(gw.url + "/metrics") as r:
            text = await r.text()
        out = {}
        for line in text.splitlines():
            if line.startswith("slogate_admission_shared_state{"):
                labels, value = line.rsplit(" ", 1)
                out[labels.split('"')[1]] = float(value)
        return out

    async def until_state(self, state: str, timeout: float = 5.0) -> None:
        async def states() -> list[str]:
            return [(await self.shared(g))["state"] for g in (self.a, self.b)]

        async def both() -> bool:
            return await states() == [state, state]

        await wait_until(both, timeout, interval=0.05, what=f"both gateways in state {state}")


@contextlib.asynccontextmanager
async def stack() -> AsyncIterator[Stack]:
    with redis_server() as redis:
        async with slogate("sim", "--decode-base-ms", str(STEP_MS), "--decode-per-seq-ms", "0",
                           ready_path="/health") as sim:
            cfg = Path(tempfile.mkstemp(prefix="slogate-shared-", suffix=".toml")[1])
            cfg.write_text(CONFIG.format(redis=redis.url, sim=sim.url, cap=CAP))
            try:
                async with slogate("serve", "--config", str(cfg), ready_path="/readyz") as a, \
                        slogate("serve", "--config", str(cfg), ready_path="/readyz") as b, \
                        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                    st = Stack(redis, sim, a, b, s)
                    await st.until_state("redis")
                    yield st
            finally:
                cfg.unlink(missing_ok=True)


async def test_two_gateways_enforce_one_global_cap_exactly() -> None:
    async with stack() as st:
        sa, sb = await st.shared(st.a), await st.shared(st.b)
        assert sa["gateway_id"] != sb["gateway_id"]
        assert await st.gauge(st.a) == {"redis": 1.0, "local": 0.0}
        t0 = time.monotonic()
        async with st.watching():
            results = await asyncio.gather(*[st.stream(st.a if i % 2 else st.b, 40)
                                             for i in range(12)])
        elapsed = time.monotonic() - t0
        assert all(r["status"] == 200 and r["done"] for r in results), results
        # Each gateway alone would admit 4 (its local cap check); together they hold 4.
        assert st.peak == CAP, st.peak
        # 12 requests of ~0.8 s at 4 at a time: three waves (not one, not twelve).
        assert 2.0 < elapsed < 8.0, elapsed
        waits = sorted(r["ttft"] for r in results)
        assert waits[3] < 0.6 < waits[4], waits  # 4 went at once, the rest queued
        for gw in (st.a, st.b):
            sh = await st.shared(gw)
            assert sh["state"] == "redis" and sh["in_flight_here"] == {"sim": 0}, sh
            assert sh["acquired_shared"] == 6 and sh["acquired_local"] == 0, sh


async def test_killed_gateway_releases_its_slots_after_the_lease() -> None:
    async with stack() as st:
        long = [asyncio.create_task(st.stream(st.a, 2000)) for _ in range(CAP)]  # ~40 s each

        async def all_at_sim() -> bool:
            return await st.at_sim() >= CAP

        await wait_until(all_at_sim, timeout=5, interval=0.02, what=f"{CAP} streams at the sim")
        # A holds all four slots.
        os.kill(st.a.popen.pid, signal.SIGKILL)
        st.a.popen.wait()
        killed = time.monotonic()
        results = await asyncio.gather(*long, return_exceptions=True)
        assert all(isinstance(r, (aiohttp.ClientError, dict)) for r in results), results
        # The simulator saw A's streams go; A's slots in Redis stay until its lease expires.
        async with st.watching():
            after = await asyncio.gather(*[st.stream(st.b, 20) for _ in range(CAP)])
        assert all(r["status"] == 200 and r["done"] for r in after), after
        waited = sorted(r["ttft"] for r in after)
        # Lease 1 s, refreshed every 1/3 s: A's slots free 0.67-1 s after the kill.
        assert waited[0] > 0.4, waited
        assert time.monotonic() - killed < 5
        assert st.peak == CAP, st.peak  # then B uses all four at once
        sh = await st.shared(st.b)
        by_gw = sh["in_flight_global"].get("sim", {}).get("by_gateway", {})
        assert set(by_gw) <= {sh["gateway_id"]}, sh  # A's field was dropped


async def test_redis_down_falls_back_to_the_local_share_and_back() -> None:
    async with stack() as st:
        st.redis.stop()
        await st.until_state("local")
        for gw in (st.a, st.b):
            assert await st.gauge(gw) == {"redis": 0.0, "local": 1.0}
        # floor(4 x 0.5) = 2 per gateway, on its own.
        async with st.watching():
            res = await asyncio.gather(*[st.stream(st.a, 20) for _ in range(5)])
        assert all(r["status"] == 200 and r["done"] for r in res), res
        assert st.peak == 2, st.peak
        async with st.watching():
            res = await asyncio.gather(*[st.stream(g, 20) for g in (st.a, st.b) * 3])
        assert all(r["status"] == 200 and r["done"] for r in res), res
        assert st.peak == 4, st.peak
        for gw in (st.a, st.b):
            assert (await st.shared(gw))["local_caps"] == {"sim": 2}
            assert "falling back to local accounting" in gw.log_text()
        # Redis returns (empty, like a restarted cache): both resync and share again.
        st.redis.start()
        await st.until_state("redis")
        for gw in (st.a, st.b):
            assert await st.gauge(gw) == {"redis": 1.0, "local": 0.0}
            assert "reachable again" in gw.log_text()
        async with st.watching():
            res = await asyncio.gather(*[st.stream(g, 20) for g in (st.a, st.b) * 4])
        assert all(r["status"] == 200 and r["done"] for r in res), res
        assert st.peak == CAP, st.peak


async def test_a_hung_redis_costs_admission_one_short_timeout() -> None:
    """SIGSTOP: connections open but nothing answers. The call that meets it waits only the
    short timeout, later ones do not wait at all (local), and SIGCONT brings sharing back with
    this gateway's counts resynced."""
    from gateway.admission.shared import SharedState
    from gateway.config import AdmissionConfig
    from gateway.telemetry.prometheus import Metrics

    with redis_server() as redis:
        cfg = AdmissionConfig(enabled=True, redis_url=redis.url, lease_s=1.0, redis_share=0.5,
                              redis_timeout_s=0.05)
        st = SharedState(cfg, Metrics())
        await st.start()
        try:
            assert st.state == "redis"
            assert await st.try_acquire("r", 4) and await st.try_acquire("r", 4)
            os.kill(redis.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            assert await st.try_acquire("r", 4) is False  # local share 2, both in use
            assert time.monotonic() - t0 < 0.3
            assert st.state == "local"
            t0 = time.monotonic()
            for _ in range(100):
                await st.try_acquire("r", 4)
            assert time.monotonic() - t0 < 0.05  # no Redis calls while local
            st.release("r")  # 1 in flight here now
            os.kill(redis.proc.pid, signal.SIGCONT)
            await wait_until(lambda: st.state == "redis", timeout=5, interval=0.02)
            assert int(await st.r.hget("slogate:inflight:r", st.gid)) == 1  # resynced
            st.release("r")  # the release reaches Redis in the background

            async def released() -> bool:
                return await st.r.hget("slogate:inflight:r", st.gid) is None

            await wait_until(released, timeout=2, what="the release reaching Redis")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(redis.proc.pid, signal.SIGCONT)
            await st.close()


async def test_a_cancelled_acquire_does_not_leak_its_slot() -> None:
    """The client leaves while the acquire script is on its way: whatever the script did is
    undone when its answer arrives."""
    from gateway.admission.shared import SharedState
    from gateway.config import AdmissionConfig

    with redis_server() as redis:
        st = SharedState(AdmissionConfig(enabled=True, redis_url=redis.url, lease_s=1.0))
        await st.start()
        try:
            for i in range(20):
                task = asyncio.create_task(st.try_acquire("c", 4))
                for _ in range(i % 5):  # cancelled at each stage of the call
                    await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                assert task.cancelled()  # the caller sees its cancellation, not a slot

            def calls_in_flight() -> int:  # scripts sent, answers not yet back
                return sum(1 for t in asyncio.all_tasks() if not t.done() and getattr(
                    t.get_coro(), "__qualname__", "") == "SharedState._call")

            async def settled() -> bool:
                """No script or release still on its way, and no slot held in Redis (a script
                that took one holds it there until its release lands)."""
                if calls_in_flight() or st._tasks:
                    return False
                return await st.r.hget("slogate:inflight:c", st.gid) is None

            await wait_until(settled, timeout=2, what="every abandoned script answered and undone")
            assert st.local.get("c", 0) == 0
            assert all([await st.try_acquire("c", 4) for _ in range(4)])  # all four are free
        finally:
            await st.close()
