"""Admission's shared state behind a slow Redis (a real redis-server behind a proxy that
delays its bytes): a far Redis still connects; callers that want slots at once share one
round trip; round trips that stay slow send admission to its local share, with one log line
each way, and fast ones bring it back. Throughput numbers: benchmarks/redis_admission.py."""
from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.admission.shared import SharedState
from gateway.config import AdmissionConfig
from gateway.telemetry.prometheus import Metrics
from tests.support.delay_proxy import delay_proxy
from tests.support.redis_server import redis_server
from tests.support.waiting import wait_until


async def evalsha_calls(st: SharedState) -> int:
    stats = await st.r.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_a_redis_40_ms_away_is_used() -> None:
    with redis_server() as redis:
        async with delay_proxy("127.0.0.1", redis.port, 0.040) as proxy:
            st = SharedState(AdmissionConfig(enabled=True,
                                             redis_url=f"redis://127.0.0.1:{proxy.port}/0"))
            await st.start()
            try:
                assert st.state == "redis", st.last_error
                assert await st.try_acquire("r", 4)
            finally:
                await st.close()


async def test_callers_at_once_share_one_round_trip() -> None:
    """40 callers want one of 16 slots at once, 10 ms from Redis: exactly 16 get one, in a
    handful of scripts, not 40."""
    with redis_server() as redis:
        async with delay_proxy("127.0.0.1", redis.port, 0.010) as proxy:
            st = SharedState(AdmissionConfig(enabled=True, lease_s=5.0,
                                             redis_url=f"redis://127.0.0.1:{proxy.port}/0"))
            await st.start()
            try:
                assert st.state == "redis"
                before = await evalsha_calls(st)
                got = await asyncio.gather(*[st.try_acquire("r", 16) for _ in range(40)])
                assert sum(got) == 16 and got[:16] == [True] * 16  # in arrival order
                assert int(await st.r.hget("slogate:inflight:r", st.gid)) == 16
                scripts = await evalsha_calls(st) - before
                assert scripts <= 3, scripts
                for _ in range(16):
                    st.release("r")

                async def released() -> bool:
                    return await st.r.hget("slogate:inflight:r", st.gid) is None

                await wait_until(released, timeout=5, what="the releases reaching Redis")
                assert await evalsha_calls(st) - before <= 3 + 4 + 1  # releases batched too
            finally:
                await st.close()


async def test_slow_round_trips_go_local_and_fast_ones_come_back(caplog) -> None:
    caplog.set_level(logging.INFO, "slogate.admission")
    with redis_server() as redis:
        async with delay_proxy("127.0.0.1", redis.port, 0.001) as proxy:
            metrics = Metrics()
            cfg = AdmissionConfig(enabled=True, lease_s=1.0, redis_share=0.5,
                                  redis_url=f"redis://127.0.0.1:{proxy.port}/0",
                                  redis_slow_ms=20, redis_slow_for_s=0.3)
            st = SharedState(cfg, metrics)
            await st.start()
            try:
                assert st.state == "redis"
                proxy.rtt_s = 0.060

                async def local_after_a_call() -> bool:
                    if await st.try_acquire("r", 4):
                        st.release("r")
                    return st.state == "local"

                await wait_until(local_after_a_call, timeout=10, interval=0.01,
                                 what="the slow fallback")
                assert st.snapshot()["local_reason"] == "slow"
                assert metrics.shared_state.labels("local")._value.get() == 1
                slow_lines = [r for r in caplog.records if "is slow" in r.getMessage()]
                assert len(slow_lines) == 1
                proxy.rtt_s = 0.001
                await wait_until(lambda: st.state == "redis", timeout=10, interval=0.02,
                                 what="shared accounting back")
                assert metrics.shared_state.labels("redis")._value.get() == 1
                back = [r for r in caplog.records if "is fast again; shared accounting resumed"
                        in r.getMessage()]
                assert len(back) == 1 and len(
                    [r for r in caplog.records if "is slow" in r.getMessage()]) == 1
            finally:
                await st.close()


@pytest.mark.parametrize("key,value", [("redis_timeout_s", 0), ("redis_pool_size", 0),
                                       ("redis_slow_ms", -1), ("redis_slow_for_s", -1)])
def test_redis_keys_are_validated(key: str, value: float) -> None:
    from gateway import config

    with pytest.raises(config.ConfigError, match=f"admission.{key}"):
        config.parse({"auth": {"mode": "open"}, "admission": {key: value},
                      "backends": [{"name": "a", "base_url": "http://x/v1"}]}, env={})
