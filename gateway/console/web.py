"""The console's HTTP side: `GET /console` (the page), its static assets, `/console/state`
(one JSON snapshot) and `/console/events` (the same snapshot pushed as SSE once a second).

The live part of a snapshot (backends, admission queue) is read from the running gateway at
the moment a browser asks; the finished-request part comes from the ConsoleRecorder. One
snapshot is computed per interval and shared by every open tab.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from gateway.console.recorder import ConsoleRecorder

BREAKER_STATES = {0: "closed", 1: "half_open", 2: "open"}
ASSETS = {"console.js": "application/javascript", "console.css": "text/css"}
PUSH_INTERVAL_S = 1.0


def _asset(name: str) -> bytes:
    return resources.files("gateway.console").joinpath("static", name).read_bytes()


def live_state(router: Any, proxy: Any, admission: Any) -> dict[str, Any]:
    """Backends (breaker, health, in flight, awaiting first token, predicted TTFT) and the
    admission queue by class and tenant, read from the gateway's own objects."""
    in_flight: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    gateway_queue: Counter[str] = Counter()
    for watchdog in list(getattr(proxy, "active", ()) or ()):
        ctx = getattr(watchdog, "ctx", None)
        if ctx is None:
            continue
        if ctx.t_sent and ctx.backend:
            in_flight[ctx.backend] += 1
            if not ctx.t_first_token:
                waiting[ctx.backend] += 1
        else:
            gateway_queue[ctx.slo.name if ctx.slo is not None else "none"] += 1
    snap: dict[str, Any] = {}
    if admission is not None:
        try:
            snap = admission.snapshot()
        except Exception:  # never let the console break on an admission change
            snap = {}
    loads = getattr(admission, "loads", {}) if admission is not None else {}
    backends = []
    for r in (router.replicas if router is not None else ()):
        row: dict[str, Any] = {
            "name": r.name, "address": f"{r.address}:{r.port}", "type": r.cfg.type,
            "models": [m for m in r.cfg.models],
            "breaker": BREAKER_STATES.get(r.breaker.state, str(r.breaker.state)),
            "healthy": bool(r.healthy), "available": bool(r.available()),
            "health_checked": bool(r.cfg.health_path),
            "in_flight": in_flight.get(r.name, 0),
            "awaiting_first_token": waiting.get(r.name, 0),
            "predicted_ttft_ms": None, "engine_waiting": None,
        }
        load = loads.get(r.name)
        if load is not None:
            try:
                est = load.est
                ttft = est.predict_ttft(load.work_ahead() + load.avg_tokens,
                                        load.decoding_now(), load.requests_ahead() + 1)
                row["predicted_ttft_ms"] = round(ttft * 1e3, 1)
                row["engine_waiting"] = load.engine_waiting
                row["cap"] = load.cap
            except Exception:
                pass
        backends.append(row)
    by_tenant: Counter[str] = Counter()
    for waiter in list(getattr(admission, "queue", ()) or ()):
        ctx = getattr(waiter, "ctx", None)
        if ctx is not None:
            by_tenant[ctx.tenant or "(no key)"] += 1
    queue = snap.get("queue") or {}
    return {
        "backends": backends,
        "models": router.models() if router is not None else [],
        "admission": {
            "enabled": admission is not None,
            "queued": queue.get("requests", 0),
            "estimated_tokens": queue.get("estimated_tokens", 0),
            "by_class": queue.get("by_class", {}),
            "by_tenant": dict(by_tenant),
        },
        "gateway_queue": dict(gateway_queue),
    }


class Console:
    """Serves the page and the pushed snapshots. `sources()` returns (router, proxy,
    admission) of the running gateway, or Nones before start-up finished."""

    def __init__(self, recorder: ConsoleRecorder,
                 sources: Callable[[], tuple[Any, Any, Any]], version: str = "") -> None:
        self.recorder = recorder
        self.sources = sources
        self.version = version
        self.closing = asyncio.Event()
        self._cached: tuple[float, bytes] | None = None

    def snapshot(self) -> dict[str, Any]:
        router, proxy, admission = self.sources()
        out = self.recorder.snapshot()
        out.update(live_state(router, proxy, admission))
        out["time"] = time.time()
        out["version"] = self.version
        return out

    def snapshot_bytes(self) -> bytes:
        """One snapshot per half interval, shared by every open tab."""
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] >= PUSH_INTERVAL_S / 2:
            self._cached = (now, orjson.dumps(self.snapshot()))
        return self._cached[1]

    # -- handlers ------------------------------------------------------------------------------
    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=_asset("console.html"), content_type="text/html",
                            charset="utf-8", headers={"Cache-Control": "no-store"})

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise web.HTTPNotFound()
        return web.Response(body=_asset(name), content_type=ASSETS[name], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def state(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.snapshot()), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        await resp.write(b"retry: 2000\n\n")
        try:
            while not self.closing.is_set():
                await resp.write(b"data: " + self.snapshot_bytes() + b"\n\n")
                try:
                    await asyncio.wait_for(self.closing.wait(), PUSH_INTERVAL_S)
                except TimeoutError:
                    pass
        except ConnectionResetError:
            pass  # the tab was closed (with handler cancellation, the task is cancelled)
        return resp

    async def _on_shutdown(self, app: web.Application) -> None:
        self.closing.set()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/console", self.page)
        app.router.add_get("/console/", self.page)
        app.router.add_get("/console/static/{name}", self.asset)
        app.router.add_get("/console/state", self.state)
        app.router.add_get("/console/events", self.events)
        app.on_shutdown.append(self._on_shutdown)
