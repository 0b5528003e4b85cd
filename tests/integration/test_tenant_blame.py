"""One tenant's requests must not make a backend look bad for the others, over real loopback
sockets against the engine simulator: a tenant that makes the engine fail (here by the
simulator's fault headers, forwarded only where the backend lists them) is held off that backend
by itself while the others are served; a backend that really fails still opens its breaker for
everyone, whether one tenant or several see it. The estimator side (a tenant whose first tokens
stall) is in test_admission.py."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.edge.auth import hash_key
from gateway.ops.server import build_app
from tests.support.servers import serve_app

FAST = {"decode_base_ms": 2, "decode_per_seq_ms": 0, "prefill_tokens_per_s": 200_000}
TENANTS = ("victim", "attacker", "bystander")


def keyed(sim: str, *, forward: bool = True, cooldown_s: float = 10.0,
          admission: bool = False) -> config.Config:
    """One simulator backend, a key per tenant (the key is `k-<tenant>`), 3 failures open."""
    backend: dict[str, Any] = {"name": "sim", "base_url": sim + "/v1", "models": ["m"]}
    if forward:
        backend["forward_headers"] = ["x-sim-*"]
    return config.parse({
        "auth": {"mode": "keys", "keys": [{"tenant": t, "sha256": hash_key(f"k-{t}")}
                                          for t in TENANTS],
                 "admin_keys": [{"sha256": hash_key("adm")}]},
        "server": {"access_log": False},
        "breaker": {"failures": 3, "cooldown_s": cooldown_s},
        "retry": {"backoff_base_s": 0.001},
        "admission": {"enabled": admission},
        "backends": [backend]}, env={})


async def chat(s: aiohttp.ClientSession, gw: str, tenant: str,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    body = {"model": "m", "stream": True, "max_tokens": 3,
            "messages": [{"role": "user", "content": "hello"}]}
    async with s.post(gw + "/v1/chat/completions", json=body, headers={
            "Authorization": f"Bearer k-{tenant}", **(headers or {})}) as r:
        if r.status == 200:
            await r.read()
            return r.status, dict(r.headers), None
        return r.status, dict(r.headers), await r.json()


async def metric(s: aiohttp.ClientSession, gw: str, name: str, **labels: str) -> float:
    async with s.get(gw + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


FAULT = {"x-sim-status": "500"}


@pytest.mark.parametrize("admission", [False, True], ids=["admission_off", "admission_on"])
async def test_one_tenant_that_makes_the_engine_fail_does_not_lock_the_others_out(
        admission: bool) -> None:
    """The finding: three requests that make the engine answer 500 opened the breaker, and the
    other tenants got 503 for its cooldown. Now the failing tenant alone is held off."""
    async with serve_app(build_sim(SimConfig(**FAST))) as sim, \
            serve_app(build_app(keyed(sim, admission=admission))) as gw, \
            aiohttp.ClientSession() as s:
        assert (await chat(s, gw, "victim"))[0] == 200
        for _ in range(3):
            status, _, body = await chat(s, gw, "attacker", FAULT)
            assert status in (500, 503), body  # its own failures (retried, then passed through)
        for _ in range(5):  # the others are served, at once and throughout
            assert (await chat(s, gw, "victim"))[0] == 200
            assert (await chat(s, gw, "bystander"))[0] == 200
        status, headers, body = await chat(s, gw, "attacker")  # even without the fault
        assert status == 503 and body["error"]["code"] == "tenant_held"  # OpenAI's format
        assert body["error"]["message"].startswith(
            "The model 'm' is not served to this tenant right now. Backend 'sim' is unavailable "
            "(held off for this tenant for another ")
        assert int(headers["Retry-After"]) >= 9
        assert await metric(s, gw, "slogate_backend_breaker_state", backend="sim") == 0
        async with s.get(gw + "/admin/backends", headers={"Authorization": "Bearer adm"}) as r:
            replica = (await r.json())["replicas"]["sim"]
        assert replica["breaker"] == "closed" and replica["held_tenants"] == ["attacker"]
        assert await metric(s, gw, "slogate_tenant_backend_holds_total", tenant="attacker",
                            backend="sim") == 1
        assert await metric(s, gw, "slogate_tenant_held_requests_total", tenant="attacker") >= 1
        assert await metric(s, gw, "slogate_tenant_held_requests_total", tenant="victim") == 0


async def test_the_simulators_fault_headers_reach_it_only_where_the_backend_lists_them() -> None:
    async with serve_app(build_sim(SimConfig(**FAST))) as sim, \
            serve_app(build_app(keyed(sim, forward=False))) as gw, aiohttp.ClientSession() as s:
        for _ in range(3):
            assert (await chat(s, gw, "attacker", FAULT))[0] == 200
        async with s.get(sim + "/sim/requests") as r:
            requests = await r.json()
        assert len(requests) == 3 and not any(h.startswith("x-sim-") for req in requests
                                              for h in req["headers"])
        assert (await chat(s, gw, "victim"))[0] == 200


async def set_fault(s: aiohttp.ClientSession, sim: str, status: int) -> None:
    async with s.post(sim + "/sim/config", json={"fault_status": status}) as r:
        assert r.status == 200


async def test_a_backend_that_really_fails_one_tenant_alone_still_opens() -> None:
    """Only one tenant uses the backend when it starts failing: its failures open the circuit
    (its requests get the classic 503), and a probe closes it once the engine recovers."""
    async with serve_app(build_sim(SimConfig(**FAST))) as sim, \
            serve_app(build_app(keyed(sim, cooldown_s=0.3))) as gw, aiohttp.ClientSession() as s:
        assert (await chat(s, gw, "victim"))[0] == 200
        await set_fault(s, sim, 500)
        assert (await chat(s, gw, "victim"))[0] == 500  # three attempts, each a 500
        status, _, body = await chat(s, gw, "victim")
        assert status == 503 and body["error"]["code"] == "no_healthy_backend"
        assert "circuit open for another 1 s after 3 failures" in body["error"]["message"]
        assert await metric(s, gw, "slogate_backend_breaker_state", backend="sim") == 2
        await set_fault(s, sim, 0)
        await asyncio.sleep(0.35)
        assert (await chat(s, gw, "victim"))[0] == 200  # the probe
        assert await metric(s, gw, "slogate_backend_breaker_state", backend="sim") == 0


async def test_a_backend_that_really_fails_two_tenants_opens_for_everyone() -> None:
    async with serve_app(build_sim(SimConfig(**FAST))) as sim, \
            serve_app(build_app(keyed(sim))) as gw, aiohttp.ClientSession() as s:
        assert (await chat(s, gw, "victim"))[0] == 200
        assert (await chat(s, gw, "bystander"))[0] == 200
        await set_fault(s, sim, 500)
        assert (await chat(s, gw, "victim"))[0] == 500  # open on the victim's word only...
        assert (await chat(s, gw, "bystander"))[0] == 500  # ...until a second tenant fails too
        for tenant in TENANTS:
            status, _, body = await chat(s, gw, tenant)
            assert status == 503 and body["error"]["code"] == "no_healthy_backend", tenant
        assert await metric(s, gw, "slogate_backend_breaker_state", backend="sim") == 2
        assert await metric(s, gw, "slogate_tenant_backend_holds_total", tenant="victim",
                            backend="sim") == 0
