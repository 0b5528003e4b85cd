"""The gateway application: routes, lifecycle, and `slogate serve`."""
from __future__ import annotations

import asyncio
import logging
import sys

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import backends
from backends import openai as openai_api
from gateway import config as config_mod
from gateway.config import Config
from gateway.errors import GatewayError
from gateway.finish import Finisher
from gateway.proxy import Proxy
from gateway.routing import Replica, Router
from gateway.telemetry.otlp_metrics import OTLPMetrics
from gateway.telemetry.prometheus import Metrics
from gateway.telemetry.tracing import Tracing

log = logging.getLogger("slogate")
CONFIG_KEY = web.AppKey("config", Config)
ROUTER_KEY = web.AppKey("router", Router)
PROXY_KEY = web.AppKey("proxy", Proxy)
METRICS_KEY = web.AppKey("metrics", Metrics)
FINISHER_KEY = web.AppKey("finisher", Finisher)


def build_app(cfg: Config, *, tracing: Tracing | None = None,
              otlp_metrics: OTLPMetrics | None = None) -> web.Application:
    """The gateway app. `tracing`/`otlp_metrics` default to what the config and the standard
    OTEL_* variables say (tests pass their own exporters)."""
    # The body limit is enforced by ingress (with a clear error), not by aiohttp's reader.
    app = web.Application(client_max_size=cfg.server.max_body_bytes + 1)
    app[CONFIG_KEY] = cfg
    metrics = Metrics(cfg.slo.thresholds_s(), cfg.slo.classes, [b.name for b in cfg.backends])
    app[METRICS_KEY] = metrics

    async def startup(app: web.Application) -> None:
        replicas = [Replica(b, cfg.server.connect_timeout_s) for b in cfg.backends]
        router = Router(replicas)
        app[ROUTER_KEY] = router
        finisher = Finisher(metrics, tracing or Tracing(cfg.telemetry),
                            otlp_metrics or OTLPMetrics(cfg.telemetry))
        app[FINISHER_KEY] = finisher
        app[PROXY_KEY] = Proxy(router, finisher, cfg.slo, cfg.auth,
                               max_body_bytes=cfg.server.max_body_bytes,
                               commit=cfg.server.commit)

    async def cleanup(app: web.Application) -> None:
        await app[ROUTER_KEY].close()
        finisher = app[FINISHER_KEY]
        # Shutdown flushes over the network and blocks: keep it off the event loop.
        await asyncio.to_thread(finisher.tracing.shutdown)
        await asyncio.to_thread(finisher.otlp.shutdown)

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)

    async def proxied(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY_KEY].handle(request)

    async def models(request: web.Request) -> web.Response:
        try:
            key = cfg.auth.authenticate(request.headers)
        except GatewayError as e:
            return web.Response(status=e.status, content_type="application/json",
                                body=openai_api.error_body(e.status, e.message, e.code))
        allowed = (lambda m: True) if key is None or "*" in key.models else key.models.__contains__
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "slogate"}
                for m in request.app[ROUTER_KEY].models() if allowed(m)]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def prometheus(request: web.Request) -> web.Response:
        body = generate_latest(request.app[METRICS_KEY].registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}, dumps=_dumps)

    async def readyz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"}, dumps=_dumps)

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, content_type="application/json",
                            body=openai_api.error_body(
                                404, f"Unknown route {request.method} {request.path}.",
                                "unknown_route"))

    for path in backends.APIS:
        app.router.add_post(path, proxied)
    app.router.add_get("/v1/models", models)
    if cfg.telemetry.prometheus:
        app.router.add_get("/metrics", prometheus)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_route("*", "/v1/{tail:.*}", not_found)
    return app


def _dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("slogate.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(config_path: str, host: str | None = None, port: int | None = None) -> int:
    setup_logging()
    try:
        cfg = config_mod.load(config_path)
    except config_mod.ConfigError as e:
        print(f"slogate: {e}", file=sys.stderr)
        return 2
    if not cfg.server.access_log:
        logging.getLogger("slogate.access").setLevel(logging.WARNING)
    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    app = build_app(cfg)
    names = ", ".join(f"{b.name} ({b.base_url})" for b in cfg.backends)
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None,
                print=lambda _: log.info("slogate listening on http://%s:%d, backends: %s",
                                         host, port, names))
    return 0
