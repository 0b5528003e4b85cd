"""The stack the provider tests drive with official SDKs: the gateway (real app, loopback
socket) in front of the engine simulator, with the gateway's access-log records at hand."""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.waiting import wait_until

FAST_SIM = dict(decode_base_ms=1.0, decode_per_seq_ms=0.0, prefill_tokens_per_s=1e7)
UPSTREAM_KEY = "sk-upstream-secret"
UPSTREAM_KEY_ENV = "SLOGATE_TEST_PROVIDER_UPSTREAM_KEY"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(json.loads(record.getMessage()))


@dataclass
class Stack:
    gw: str  # gateway base URL (no path)
    sim: str  # simulator base URL
    gw_app: web.Application
    sim_app: web.Application
    _log: _Records = field(repr=False, default_factory=_Records)

    async def records(self, n: int = 1, timeout: float = 2.0) -> list[dict[str, Any]]:
        """The gateway's access-log records, once there are at least n (a request is logged
        just after its response ends, so the client may be a moment ahead)."""
        await wait_until(lambda: len(self._log.records) >= n, timeout,
                         what=lambda: f"{n} access-log records (have {self._log.records})")
        return self._log.records

    async def get(self, url: str) -> Any:
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            assert r.status == 200, await r.text()
            return await r.json() if r.content_type == "application/json" else await r.text()

    async def sim_requests(self) -> list[dict[str, Any]]:
        """What reached the simulator: method, path, headers (lower-case names), body."""
        requests: list[dict[str, Any]] = await self.get(self.sim + "/sim/requests")
        return requests

    async def metrics(self) -> str:
        text: str = await self.get(self.gw + "/metrics")
        return text


def assert_provider_stages(record: dict[str, Any], timing: Any) -> None:
    """The access log's provider stages are exactly what the provider reported (Groq's
    usage timings, Cerebras' time_info: seconds) in ms."""
    ms = record["ms"]
    assert ms["provider_queue"] == pytest.approx(timing.queue_time * 1e3, abs=1e-3)
    assert ms["provider_prefill"] == pytest.approx(timing.prompt_time * 1e3, abs=1e-3)
    assert ms["provider_decode"] == pytest.approx(timing.completion_time * 1e3, abs=1e-3)


@contextlib.asynccontextmanager
async def stack(backend_type: str = "openai", base_path: str = "/v1", *,
                sim: dict[str, Any] | None = None, backend: dict[str, Any] | None = None,
                **sections: Any) -> AsyncIterator[Stack]:
    """Simulator (fast engine, plus `sim` knobs) behind the gateway with one backend of
    `backend_type` at sim URL + `base_path` serving model "m". `sections` are further config
    sections (auth defaults to open mode); the upstream key is injected when
    `backend` names UPSTREAM_KEY_ENV as api_key_env."""
    sim_app = build_sim(SimConfig(**{**FAST_SIM, **(sim or {})}))
    handler = _Records()
    access = logging.getLogger("slogate.access")
    access.addHandler(handler)
    try:
        async with serve_app(sim_app) as sim_url:
            raw = {"auth": {"mode": "open"}, "server": {"access_log": True}, **sections,
                   "backends": [{"name": "sim", "type": backend_type,
                                 "base_url": sim_url + base_path, "models": ["m"],
                                 "forward_headers": ["x-sim-*"], **(backend or {})}]}
            gw_app = build_app(config.parse(raw, env={}))
            async with serve_app(gw_app) as gw_url:
                yield Stack(gw_url, sim_url, gw_app, sim_app, handler)
    finally:
        access.removeHandler(handler)
