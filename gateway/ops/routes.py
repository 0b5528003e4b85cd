"""The gateway's routes: the proxied API calls (whose phases are gateway/request/proxy.py's),
and the gateway's own answers — models, metrics, health, readiness, the admin state, and the
errors for an unknown route or a wrong method, each in the client's API format."""
from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from prometheus_client.exposition import choose_encoder

import gateway
from gateway.apis import LOCAL_ROUTES, ROUTES, chat, messages
from gateway.apis.base import Api, Handler
from gateway.config import Config
from gateway.edge import limits
from gateway.edge.auth import AuthPolicy
from gateway.errors import GatewayError
from gateway.exchange import new_request_id
from gateway.ops.keys import (
    ADMISSION_KEY,
    CONFIG_KEY,
    DECISIONS_KEY,
    DRAINING_KEY,
    METRICS_KEY,
    PROXY_KEY,
    ROUTER_KEY,
    WORKER_KEY,
)
from gateway.request.proxy import REQUEST_ID_HEADER
from gateway.telemetry.decisions import FILTERS, MAX_QUERY
from gateway.upstream.routing import Router


def client_api(request: web.Request) -> Api:
    """The API format of a request outside the proxied routes: Anthropic's SDK always sends
    anthropic-version; everyone else gets OpenAI's."""
    return messages.API if "anthropic-version" in request.headers else chat.API


def with_id(handler: Handler) -> Handler:
    """The gateway's own answers carry a request id too (proxied ones get theirs from the
    request's context)."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        resp = await handler(request)
        if not resp.prepared:
            resp.headers.setdefault(REQUEST_ID_HEADER, new_request_id())
        return resp
    return wrapped


class Routes:
    """The handlers of one gateway app. `app` is the main application: a handler served on
    the admin listener reads the gateway's state from it, not from the admin app."""

    def __init__(self, app: web.Application, auth: AuthPolicy) -> None:
        self.app = app
        self.auth = auth

    def add(self, cfg: Config, admin_app: web.Application) -> None:
        """Every route, on the main app or (per [server] admin_*) on the admin app."""
        app = self.app
        for path in ROUTES:
            app.router.add_post(path, self.proxied)
        for path, (method, handler) in LOCAL_ROUTES.items():
            app.router.add_route(method, path, with_id(handler))
        app.router.add_get("/v1/models", with_id(self.models))
        if cfg.telemetry.prometheus:
            (admin_app if cfg.server.admin_metrics else app).router.add_get(
                "/metrics", with_id(self.prometheus))
        admin_app.router.add_get("/admin/admission",
                                 with_id(self.admin_only(self.admission_state)))
        admin_app.router.add_get("/admin/backends", with_id(self.admin_only(self.backends_state)))
        admin_app.router.add_get("/admin/decisions", with_id(self.admin_only(self.decisions)))
        app.router.add_get("/", with_id(self.index))
        app.router.add_get("/healthz", with_id(self.healthz))
        app.router.add_get("/readyz", with_id(self.readyz))
        answer_wrong_methods(app)
        app.router.add_route("*", "/v1/{tail:.*}", with_id(self.not_found))

    async def index(self, request: web.Request) -> web.Response:
        """What a person who opens the gateway's address finds: where to go next."""
        cfg = self.app[CONFIG_KEY].server
        admin = f"the admin listener (port {cfg.admin_port})" if cfg.admin_port else None

        def where(path: str, on_admin: bool) -> str:
            return f"{path} on {admin}" if on_admin and admin else path

        body = {"service": "slogate", "version": gateway.version(),
                "console": where("/console", cfg.admin_console),
                "metrics": where("/metrics", cfg.admin_metrics),
                "health": "/healthz", "ready": "/readyz", "models": "/v1/models",
                "api": sorted(ROUTES)}
        return web.json_response(body, dumps=_dumps)

    async def proxied(self, request: web.Request) -> web.StreamResponse:
        return await self.app[PROXY_KEY].handle(request)

    async def models(self, request: web.Request) -> web.Response:
        api = client_api(request)
        try:
            key = self.auth.authenticate(request.headers)
        except GatewayError as e:
            return web.Response(status=e.status, content_type="application/json",
                                body=api.error_body(e.status, e.message, e.code))
        names = [m for m in self.app[ROUTER_KEY].models() if self.auth.allows(key, m)]
        if api is messages.API:  # ModelInfo list, as anthropic's models.list() reads it
            data: list[dict[str, Any]] = [{"type": "model", "id": m, "display_name": m,
                                           "created_at": "1970-01-01T00:00:00Z"} for m in names]
            return web.json_response({"data": data, "has_more": False,
                                      "first_id": names[0] if names else None,
                                      "last_id": names[-1] if names else None}, dumps=_dumps)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "slogate"} for m in names]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def prometheus(self, request: web.Request) -> web.Response:
        # OpenMetrics when the scraper asks for it: that format carries exemplars (trace ids).
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        worker = self.app[WORKER_KEY]
        registry = self.app[METRICS_KEY].registry
        body = worker.exposition(registry, encoder) if worker is not None else encoder(registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    def admin_only(self, handler: Handler) -> Handler:
        """/admin/*: an admin key ([[auth.admin_keys]], hashed like the others), never a
        tenant's key; open only in open mode with no admin keys configured."""
        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                self.auth.authenticate_admin(request.headers)
            except GatewayError as e:
                return web.Response(status=e.status, content_type="application/json",
                                    body=chat.error_body(e.status, e.message, e.code))
            return await handler(request)
        return guarded

    async def admission_state(self, request: web.Request) -> web.Response:
        ctrl = self.app[ADMISSION_KEY]
        body = ctrl.snapshot() if ctrl is not None else {"enabled": False}
        worker = self.app[WORKER_KEY]
        if worker is not None:
            body = worker.host_admission_view(body)
        return web.json_response(body, dumps=_dumps)

    async def decisions(self, request: web.Request) -> web.Response:
        """The flight recorder: the newest admission and routing decisions first, filtered by
        `?outcome=`, `?slo_class=`, `?tenant=` (the label), `?verdict=`, `?decision=`, at
        most `?limit=` (default 100, at most MAX_QUERY) of them."""
        log = self.app[DECISIONS_KEY]
        if log is None:
            return web.json_response({"recorder": None, "decisions": []}, dumps=_dumps)
        q = request.query
        raw = q.get("limit", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_QUERY:
            return web.Response(status=400, content_type="application/json", body=chat.error_body(
                400, f"'limit' must be an integer from 1 to {MAX_QUERY}, not "
                f"{limits.clip(raw, 16)!r}.", "invalid_limit"))
        match = {k: q[k] for k in FILTERS if k in q}
        return web.Response(body=log.body(int(raw), **match), content_type="application/json")

    async def backends_state(self, request: web.Request) -> web.Response:
        """Per-model and per-replica health: breakers, active checks, what is available."""
        return web.json_response(backend_health(self.app[ROUTER_KEY]), dumps=_dumps)

    async def healthz(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {"status": "ok"}
        if request.query.get("verbose") == "1" and ROUTER_KEY in self.app:
            body["models_without_backend"] = self.app[ROUTER_KEY].unavailable_models()
        return web.json_response(body, dumps=_dumps)

    async def readyz(self, request: web.Request) -> web.Response:
        """This process only: listening, config loaded, not draining. A backend's health is
        not this pod's readiness (every pod would leave rotation for every model at once);
        it is in /admin/backends."""
        if self.app[DRAINING_KEY].is_set():
            return web.json_response({"status": "draining"}, status=503, dumps=_dumps)
        if PROXY_KEY not in self.app:
            return web.json_response({"status": "starting"}, status=503, dumps=_dumps)
        return web.json_response({"status": "ready"}, dumps=_dumps)

    async def not_found(self, request: web.Request) -> web.Response:
        return web.Response(status=404, content_type="application/json",
                            body=client_api(request).error_body(
                                404, f"Unknown route {limits.clip(request.method, 16)} "
                                f"{limits.clip(request.path)}.",
                                "unknown_route"))


def backend_health(router: Router) -> dict[str, Any]:
    """What /admin/backends answers: each model's available replicas, each replica's breaker
    (open on one tenant's failures alone: `opened_by`; tenants its own failures hold off:
    `held_tenants`) and active-check state."""
    states = {0: "closed", 1: "half_open", 2: "open"}
    replicas = {r.name: {"models": list(r.cfg.models), "breaker": states.get(r.breaker.state),
                         "opened_by": r.breaker.opened_by if r.breaker.state else None,
                         "held_tenants": sorted(t for t in r.breaker.holds
                                                if r.breaker.held(t)),
                         "healthy": r.healthy, "available": r.available(),
                         "retry_after_s": round(r.breaker.retry_after_s(), 3)}
                for r in router.replicas}
    models = {}
    for model in router.models() or ["*"]:
        reps = [r for r in router.replicas if model in r.cfg.models or model in r.cfg.aliases
                or (model == "*" and r.cfg.wildcard)]
        models[model] = {"replicas": [r.name for r in reps],
                         "available": [r.name for r in reps if r.available()]}
    return {"models": models, "replicas": replicas,
            "models_without_backend": router.unavailable_models()}


def answer_wrong_methods(app: web.Application) -> None:
    """A known path asked with a method it does not serve: 405 with `Allow`, in the API's
    error format (not the catch-all's 404 "Unknown route")."""
    allowed: dict[str, set[str]] = {}
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path")
        if path is not None and route.method != "*":
            allowed.setdefault(path, set()).add(route.method)
    for path, methods in allowed.items():
        allow = ", ".join(sorted(methods))

        async def wrong_method(request: web.Request, allow: str = allow) -> web.Response:
            return web.Response(status=405, content_type="application/json",
                                headers={"Allow": allow, REQUEST_ID_HEADER: new_request_id()},
                                body=client_api(request).error_body(
                                    405, f"Method {request.method} is not allowed on "
                                    f"{request.path}; allowed: {allow}.", "method_not_allowed"))

        app.router.add_route("*", path, wrong_method)


def _dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()
