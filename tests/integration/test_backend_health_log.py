"""What an operator and a client learn when a backend dies, over real sockets: the 503 that
follows the breaker opening names the backend and its last failure (in the client's API
format), the server log has one line each for it failing, its circuit opening and closing, its
health check failing and recovering, and a counter carries each."""
from __future__ import annotations

import logging

import aiohttp
import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import build_app
from tests.support.prometheus_server import free_port
from tests.support.servers import serve_app
from tests.support.waiting import wait_until

FAST = dict(decode_base_ms=2, decode_per_seq_ms=0, prefill_tokens_per_s=1e6)
MSG = [{"role": "user", "content": "hello"}]


def health_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "slogate.health"]


async def metric(base: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("admission", [False, True], ids=["admission_off", "admission_on"])
async def test_a_dead_backend_is_named_with_its_cause_until_it_recovers(
        caplog: pytest.LogCaptureFixture, admission: bool) -> None:
    caplog.set_level(logging.WARNING, "slogate.health")
    port = free_port()  # nothing listens: every connect is refused
    cfg = config.parse({
        "auth": {"mode": "open"},
        "backends": [{"name": "local", "base_url": f"http://127.0.0.1:{port}/v1",
                      "models": ["m"]}],
        "breaker": {"failures": 3, "cooldown_s": 1.0},
        "admission": {"enabled": admission},
    }, env={})
    async with serve_app(build_app(cfg)) as base:
        client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        errors: list[openai.APIStatusError] = []
        for _ in range(6):
            try:
                await client.chat.completions.create(model="m", messages=MSG)
            except openai.APIStatusError as e:
                errors.append(e)
        assert errors[0].status_code == 502  # the first ones: the connect error itself
        assert f"127.0.0.1:{port}: connection refused" in errors[0].message
        last = errors[-1]
        assert last.status_code == 503 and isinstance(last.body, dict)
        assert last.body["code"] == "no_healthy_backend"
        message = last.body["message"]
        assert message.startswith("No healthy backend for the model 'm' right now. Backend "
                                  "'local' is unavailable (circuit open for another 1 s after "
                                  "3 failures; last failure ")
        assert message.endswith(f" ago: 127.0.0.1:{port}: connection refused).")
        assert await metric(base, "slogate_breaker_transitions_total", backend="local",
                            to="open") == 1

        # The engine comes back on its port: after the cooldown a probe closes the circuit.
        async with serve_app(build_sim(SimConfig(**FAST)), port=port):
            async def answered() -> bool:
                try:
                    await client.chat.completions.create(model="m", messages=MSG, max_tokens=2)
                    return True
                except openai.APIStatusError:
                    return False
            await wait_until(answered, timeout=5, interval=0.2, what="the backend recovering")
            assert await metric(base, "slogate_breaker_transitions_total", backend="local",
                                to="closed") == 1
        await client.close()
    assert health_lines(caplog) == [
        f"backend 'local' is failing: 127.0.0.1:{port}: connection refused",
        f"backend 'local' is unavailable: circuit open for 1.0 s (after 3 failures in a row; "
        f"last: 127.0.0.1:{port}: connection refused)",
        health_lines(caplog)[2],
    ]
    assert health_lines(caplog)[2].startswith("backend 'local' recovered: circuit closed (")


async def test_a_failing_health_check_is_logged_with_its_reason_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "slogate.health")
    status = {"now": 200}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=status["now"])

    engine = web.Application()
    engine.router.add_get("/health", health)
    async with serve_app(engine) as url:
        cfg = config.parse({
            "auth": {"mode": "open"},
            "backends": [{"name": "local", "base_url": url + "/v1", "models": ["m"],
                          "health_path": "/health", "health_interval_s": 0.05}],
        }, env={})
        async with serve_app(build_app(cfg)) as base:
            status["now"] = 500
            await wait_until(lambda: len(health_lines(caplog)) == 1, timeout=5,
                             what="the failed check's line")
            assert await metric(base, "slogate_backend_healthy", backend="local") == 0
            assert await metric(base, "slogate_health_check_failures_total",
                                backend="local") >= 1
            async with aiohttp.ClientSession() as s, s.post(
                    base + "/v1/chat/completions", json={"model": "m", "messages": MSG}) as r:
                assert r.status == 503
                assert "failing its health check for " in (await r.json())["error"]["message"]
            status["now"] = 200
            await wait_until(lambda: len(health_lines(caplog)) == 2, timeout=5,
                             what="the recovered check's line")
            async def healthy_again() -> bool:
                return await metric(base, "slogate_backend_healthy", backend="local") == 1

            await wait_until(healthy_again, what="slogate_backend_healthy back to 1")
    assert health_lines(caplog)[0] == "backend 'local' failed its health check: /health: status 500"
    assert health_lines(caplog)[1].startswith("backend 'local' passes its health check again "
                                              "(after ")
