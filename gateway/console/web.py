"""The console's HTTP side: `GET /console` (the page), its static assets, `/console/state`
(one JSON snapshot) and `/console/events` (the same snapshot pushed as SSE once a second).

The live part of a snapshot (backends, admission queue) is read from the running gateway at
the moment a browser asks; the finished-request part comes from the ConsoleRecorder, and why
the newest refused or slow requests were so from the decision log (console/why.py). A snapshot
is computed at most once per STATE_MAX_AGE_S and shared by every open tab and every poll of
/console/state: a loop of polls costs a cached write each, not a recomputation.

The console has no key, so it answers only a `Host` it knows (gateway/edge/hosts.py: DNS
rebinding), and every answer says the page may load only its own script, stylesheet and event
stream, may not be framed, and leaks no referrer.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from gateway.admission.controller import AdmissionView
from gateway.console.recorder import ConsoleRecorder
from gateway.console.why import explain
from gateway.edge import limits
from gateway.edge.hosts import HostAllowList
from gateway.request.proxy import RequestsView
from gateway.telemetry.decisions import DecisionLog
from gateway.upstream.routing import ReplicaView

ConsoleHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BREAKER_STATES = {0: "closed", 1: "half_open", 2: "open"}
ASSETS = {"console.js": "application/javascript", "console.css": "text/css"}
PUSH_INTERVAL_S = 1.0
STATE_MAX_AGE_S = 0.25  # how old a snapshot /console/state or a push may serve
EXPLAINED = 10  # refused or slow requests the snapshot explains (the newest)
# What console.html and console.js load: their own script, stylesheet and event stream (the
# charts are DOM-built SVG, styles set through CSSOM), nothing else.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Frame-Options": "DENY",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def _asset(name: str) -> bytes:
    return resources.files("gateway.console").joinpath("static", name).read_bytes()


@dataclass(frozen=True, slots=True)
class Live:
    """What the running gateway publishes for the console, read at the moment a browser asks:
    its replicas, the requests in progress and admission's queue (None: admission is off)."""
    replicas: Sequence[ReplicaView]
    models: list[str]
    requests: RequestsView
    admission: AdmissionView | None


def live_state(live: Live | None) -> dict[str, Any]:
    """Backends (breaker, health, in flight, awaiting first token, predicted TTFT) and the
    admission queue by class and tenant (all empty before start-up has finished)."""
    if live is None:
        return {"backends": [], "models": [], "gateway_queue": {},
                "admission": {"enabled": False, "queued": 0, "estimated_tokens": 0,
                              "by_class": {}, "by_tenant": {}}}
    requests, admission = live.requests, live.admission
    loads = admission.replicas if admission is not None else {}
    backends = []
    for r in live.replicas:
        row: dict[str, Any] = {
            "name": r.name, "address": r.address, "type": r.type, "models": list(r.models),
            "breaker": BREAKER_STATES.get(r.breaker, str(r.breaker)),
            "healthy": r.healthy, "available": r.available, "health_checked": r.health_checked,
            "in_flight": requests.in_flight.get(r.name, 0),
            "awaiting_first_token": requests.awaiting_first_token.get(r.name, 0),
            "predicted_ttft_ms": None, "engine_waiting": None,
        }
        load = loads.get(r.name)
        if load is not None:
            row["predicted_ttft_ms"] = load.predicted_ttft_ms
            row["engine_waiting"] = load.engine_waiting
            row["cap"] = load.cap
        backends.append(row)
    return {
        "backends": backends,
        "models": live.models,
        "admission": {
            "enabled": admission is not None,
            "queued": admission.queued if admission is not None else 0,
            "estimated_tokens": admission.estimated_tokens if admission is not None else 0,
            "by_class": admission.by_class if admission is not None else {},
            "by_tenant": admission.by_tenant if admission is not None else {},
        },
        "gateway_queue": requests.gateway_queue,
    }


class Console:
    """Serves the page and the pushed snapshots. `live()` is what the running gateway
    publishes now (None before start-up has finished)."""

    def __init__(self, recorder: ConsoleRecorder, live: Callable[[], Live | None],
                 version: str = "", hosts: HostAllowList | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 decisions: DecisionLog | None = None) -> None:
        self.recorder = recorder
        self.decisions = decisions  # the flight recorder: why a request was refused or slow
        self.live = live
        self.version = version
        self.hosts = hosts or HostAllowList(())
        self.clock = clock
        self.closing = asyncio.Event()
        self._cached: tuple[float, bytes] | None = None

    def snapshot(self) -> dict[str, Any]:
        out = self.recorder.snapshot()
        out.update(live_state(self.live()))
        out["explained"] = ([explain(r) for r in self.decisions.explainable(EXPLAINED)]
                            if self.decisions is not None else [])
        out["time"] = time.time()
        out["version"] = self.version
        return out

    def snapshot_bytes(self) -> bytes:
        """The snapshot as JSON, computed at most once per STATE_MAX_AGE_S and shared by every
        tab and poll."""
        now = self.clock()
        if self._cached is None or now - self._cached[0] >= STATE_MAX_AGE_S:
            self._cached = (now, orjson.dumps(self.snapshot()))
        return self._cached[1]

    # -- handlers ------------------------------------------------------------------------------
    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=_asset("console.html"), content_type="text/html",
                            charset="utf-8", headers={"Cache-Control": "no-store",
                                                      **SECURITY_HEADERS})

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise web.HTTPNotFound(headers=SECURITY_HEADERS)
        return web.Response(body=_asset(name), content_type=ASSETS[name], charset="utf-8",
                            headers={"Cache-Control": "no-cache", **SECURITY_HEADERS})

    async def state(self, request: web.Request) -> web.Response:
        return web.Response(body=self.snapshot_bytes(), content_type="application/json",
                            headers={"Cache-Control": "no-store", **SECURITY_HEADERS})

    async def events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no", **SECURITY_HEADERS})
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

    def known_host(self, handler: ConsoleHandler) -> ConsoleHandler:
        """The handler, for a Host the console answers; else 403 (and nothing of the page)."""
        async def checked(request: web.Request) -> web.StreamResponse:
            host = request.headers.get("Host")
            if not self.hosts.allows(host):
                return web.Response(
                    status=403, content_type="text/plain", headers=SECURITY_HEADERS,
                    text=f"The console does not answer Host {limits.clip(host, 128)!r}; add "
                    "it to [server] console_hosts to open it under that name.\n")
            return await handler(request)
        return checked

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/console", self.known_host(self.page))
        app.router.add_get("/console/", self.known_host(self.page))
        app.router.add_get("/console/static/{name}", self.known_host(self.asset))
        app.router.add_get("/console/state", self.known_host(self.state))
        app.router.add_get("/console/events", self.known_host(self.events))
        app.on_shutdown.append(self._on_shutdown)
