"""A client that goes away in any phase frees the engine at once (the simulator counts it)."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.waiting import wait_until


async def sim_stats(session: aiohttp.ClientSession, sim_url: str) -> dict:
    async with session.get(sim_url + "/sim/stats") as r:
        return await r.json()


async def sim_shows(session: aiohttp.ClientSession, sim_url: str, key: str, n: int) -> bool:
    return (await sim_stats(session, sim_url))[key] == n


def body(prompt_chars: int = 20, max_tokens: int = 200) -> dict:
    return {"model": "m", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "x" * prompt_chars}]}


@pytest.mark.parametrize("phase", ["queued", "headers", "prefill", "decode"])
async def test_disconnect_reaches_the_engine_within_100ms(phase: str) -> None:
    # One sequence at a time, slow prefill: a second request waits in the engine's queue, a
    # big prompt sits in prefill, a running one decodes.
    sim_app = build_sim(SimConfig(max_batch=1, prefill_tokens_per_s=2000,
                                  prefill_chunk_tokens=64, decode_base_ms=20,
                                  decode_per_seq_ms=0))
    async with serve_app(sim_app) as sim_url:
        cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": False},
                            "backends": [{"name": "sim", "base_url": sim_url + "/v1",
                                          "forward_headers": ["x-sim-*"]}]})
        app = build_app(cfg)
        async with serve_app(app) as gw, aiohttp.ClientSession() as s:
            url = gw + "/v1/chat/completions"
            blocker = None
            if phase == "queued":
                blocker = asyncio.create_task(s.post(url, json=body(max_tokens=100)))
                await wait_until(lambda: sim_shows(s, sim_url, "running", 1))
                victim = await_task = asyncio.create_task(s.post(url, json=body()))
                await wait_until(lambda: sim_shows(s, sim_url, "waiting", 1))
                await_task.cancel()
            elif phase == "headers":  # the engine has not even answered with headers yet
                victim = asyncio.create_task(s.post(url, json=body(),
                                                    headers={"x-sim-hang": "headers"}))
                await wait_until(lambda: sim_shows(s, sim_url, "hanging", 1))
                victim.cancel()
            elif phase == "prefill":
                # ~8000 prompt tokens at 2000 tok/s: 4 s of prefill.
                victim = asyncio.create_task(s.post(url, json=body(prompt_chars=32000)))
                await wait_until(lambda: sim_shows(s, sim_url, "prefilling", 1))
                victim.cancel()
            else:
                r = await s.post(url, json=body())
                await r.content.readuntil(b'"content":" ')
                await r.content.readuntil(b"\n\n")
                r.close()
            t_cancel = time.monotonic()
            engine_phase = "queued" if phase == "headers" else phase  # the sim never queued it

            async def engine_cancelled() -> dict[str, int]:
                stats = await sim_stats(s, sim_url)
                return stats["cancellations"] if stats["cancellations"].get(engine_phase) else {}

            cancellations = await wait_until(engine_cancelled, timeout=1.0)
            elapsed = time.monotonic() - t_cancel
            counted = {k: v for k, v in cancellations.items() if v}
            assert counted == {engine_phase: 1}, counted
            assert elapsed < 0.1, elapsed
            if blocker is not None:
                (await blocker).close()
            gateway_phase = "decode" if phase == "decode" else "prefill"  # the gateway sent it
            line = (f'slogate_cancellations_total{{backend="sim",model="other",'
                    f'phase="{gateway_phase}",route="/v1/chat/completions"}} 1.0')

            async def gateway_counted() -> bool:
                async with s.get(gw + "/metrics") as r:
                    return line in await r.text()

            await wait_until(gateway_counted, timeout=2.0, what=line)
