"""The gateway application: routes, lifecycle, and `slogate serve`."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys

import orjson
from aiohttp import web
from prometheus_client.exposition import choose_encoder

import backends
from backends import anthropic as anthropic_api
from backends import openai as openai_api
from gateway import config as config_mod
from gateway import deadlines, limits, listener
from gateway.config import Config
from gateway.admission.controller import AdmissionController
from gateway.errors import GatewayError
from gateway.finish import Finisher
from gateway.context import new_request_id
from gateway.proxy import REQUEST_ID_HEADER, Proxy
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
DRAINING_KEY = web.AppKey("draining", asyncio.Event)
ADMISSION_KEY = web.AppKey("admission", object)
SHARED_KEY = web.AppKey("shared_state", object)


def build_app(cfg: Config, *, tracing: Tracing | None = None,
              otlp_metrics: OTLPMetrics | None = None) -> web.Application:
    """The gateway app. `tracing`/`otlp_metrics` default to what the config and the standard
    OTEL_* variables say (tests pass their own exporters)."""
    listener.install_log_redaction()
    # The body limit is enforced by ingress (with a clear error), not by aiohttp's reader.
    app = web.Application(client_max_size=cfg.server.max_body_bytes + 1)
    app[CONFIG_KEY] = cfg
    app[DRAINING_KEY] = asyncio.Event()
    metrics = Metrics(cfg.slo.thresholds_s(), cfg.slo.classes, [b.name for b in cfg.backends])
    app[METRICS_KEY] = metrics

    async def startup(app: web.Application) -> None:
        replicas = [Replica(b, cfg.breaker, lambda name, st: metrics.breaker.labels(name).set(st))
                    for b in cfg.backends]
        for r in replicas:
            r.start_health_checks()
        router = Router(replicas)
        app[ROUTER_KEY] = router
        finisher = Finisher(metrics, tracing or Tracing(cfg.telemetry),
                            otlp_metrics or OTLPMetrics(cfg.telemetry), cfg.telemetry.prometheus)
        app[FINISHER_KEY] = finisher
        admission = shared = None
        if cfg.admission.enabled:
            if cfg.admission.redis_url:
                from gateway.admission.shared import SharedState  # imports redis only if used

                shared = SharedState(cfg.admission, metrics)
                await shared.start()
            admission = AdmissionController(cfg.admission, router, metrics, shared=shared)
            if shared is not None:
                shared.attach(admission)
            admission.start()
        app[SHARED_KEY] = shared
        app[ADMISSION_KEY] = admission
        app[PROXY_KEY] = Proxy(cfg, router, finisher, admission)

    async def cleanup(app: web.Application) -> None:
        if app.get(ADMISSION_KEY) is not None:
            await app[ADMISSION_KEY].close()
        if app.get(SHARED_KEY) is not None:
            await app[SHARED_KEY].close()
        await app[ROUTER_KEY].close()
        finisher = app[FINISHER_KEY]
        # Shutdown flushes over the network and blocks: keep it off the event loop.
        await asyncio.to_thread(finisher.tracing.shutdown)
        await asyncio.to_thread(finisher.otlp.shutdown)

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)

    async def proxied(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY_KEY].handle(request)

    def client_api(request: web.Request):
        """The API format of a request outside the proxied routes: Anthropic's SDK always sends
        anthropic-version; everyone else gets OpenAI's."""
        return anthropic_api if "anthropic-version" in request.headers else openai_api

    async def models(request: web.Request) -> web.Response:
        api = client_api(request)
        try:
            key = cfg.auth.authenticate(request.headers)
        except GatewayError as e:
            return web.Response(status=e.status, content_type="application/json",
                                body=api.error_body(e.status, e.message, e.code))
        allowed = (lambda m: True) if key is None or "*" in key.models else key.models.__contains__
        names = [m for m in request.app[ROUTER_KEY].models() if allowed(m)]
        if api is anthropic_api:  # ModelInfo list, as anthropic's models.list() reads it
            data = [{"type": "model", "id": m, "display_name": m,
                     "created_at": "1970-01-01T00:00:00Z"} for m in names]
            return web.json_response({"data": data, "has_more": False,
                                      "first_id": names[0] if names else None,
                                      "last_id": names[-1] if names else None}, dumps=_dumps)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "slogate"} for m in names]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def prometheus(request: web.Request) -> web.Response:
        # OpenMetrics when the scraper asks for it: that format carries exemplars (trace ids).
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(request.app[METRICS_KEY].registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def admission_state(request: web.Request) -> web.Response:
        try:
            cfg.auth.authenticate(request.headers)
        except GatewayError as e:
            return web.Response(status=e.status, content_type="application/json",
                                body=openai_api.error_body(e.status, e.message, e.code))
        ctrl = request.app[ADMISSION_KEY]
        body = ctrl.snapshot() if ctrl is not None else {"enabled": False}
        return web.json_response(body, dumps=_dumps)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}, dumps=_dumps)

    async def readyz(request: web.Request) -> web.Response:
        if request.app[DRAINING_KEY].is_set():
            return web.json_response({"status": "draining"}, status=503, dumps=_dumps)
        down = request.app[ROUTER_KEY].unavailable_models()
        if down:
            return web.json_response({"status": "unavailable", "models_without_backend": down},
                                     status=503, dumps=_dumps)
        return web.json_response({"status": "ready"}, dumps=_dumps)

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, content_type="application/json",
                            body=client_api(request).error_body(
                                404, f"Unknown route {limits.clip(request.method, 16)} "
                                f"{limits.clip(request.path)}.",
                                "unknown_route"))

    for path in backends.APIS:
        app.router.add_post(path, proxied)
    def with_id(handler):
        """The gateway's own answers carry a request id too (proxied ones get theirs from
        the request's context)."""
        async def wrapped(request: web.Request) -> web.StreamResponse:
            resp = await handler(request)
            if not resp.prepared:
                resp.headers.setdefault(REQUEST_ID_HEADER, new_request_id())
            return resp
        return wrapped

    for path, (method, handler) in backends.LOCAL_ROUTES.items():
        app.router.add_route(method, path, with_id(handler))
    app.router.add_get("/v1/models", with_id(models))
    if cfg.telemetry.prometheus:
        app.router.add_get("/metrics", with_id(prometheus))
    app.router.add_get("/admin/admission", with_id(admission_state))
    app.router.add_get("/healthz", with_id(healthz))
    app.router.add_get("/readyz", with_id(readyz))
    app.router.add_route("*", "/v1/{tail:.*}", with_id(not_found))
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


async def drain(app: web.Application, timeout_s: float) -> None:
    """Wait for requests in flight to finish, up to `timeout_s`; then end the rest (streams
    get an error event in their API format)."""
    proxy = app[PROXY_KEY]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while proxy.active and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if proxy.active:
        log.warning("drain: ending %d requests still in flight after %.0f s",
                    len(proxy.active), timeout_s)
        proxy.end_all(deadlines.SHUTDOWN)
        while proxy.active:
            await asyncio.sleep(0.01)


async def start(app: web.Application, cfg: Config, host: str,
                port: int) -> tuple[web.AppRunner, listener.GuardedSite]:
    """Listen with the listener limits of [server] (header deadline, idle keep-alive timeout,
    connection caps in total and per client address, descriptor budget)."""
    s = cfg.server
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=s.drain_timeout_s + 5,
                           **listener.runner_kwargs(s))
    await runner.setup()
    max_conns = listener.fd_budget(s.max_connections, sum(b.pool_size for b in cfg.backends))
    guard = listener.ConnectionGuard(max_conns, s.max_connections_per_client,
                                     s.header_timeout_s, app[METRICS_KEY])
    site = listener.GuardedSite(runner, host, port, guard)
    await site.start()
    return runner, site


async def serve(cfg: Config, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT, then drain: /readyz turns false, listening stops after the
    readiness grace, requests in flight get the drain timeout."""
    app = build_app(cfg)
    runner, site = await start(app, cfg, host, port)
    # Everything allocated so far lives for the process; keep the collector off it, and
    # collect the young generation less often (the relay allocates a little per read).
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
    names = ", ".join(f"{b.name} ({b.base_url})" for b in cfg.backends)
    log.info("listening on http://%s:%d, backends: %s", host, port, names)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining (up to %.0f s)", cfg.server.drain_timeout_s)
    app[DRAINING_KEY].set()
    if cfg.server.readiness_grace_s:
        await asyncio.sleep(cfg.server.readiness_grace_s)
    await site.stop()  # no new connections
    await drain(app, cfg.server.drain_timeout_s)
    await runner.cleanup()
    log.info("stopped")


def run(config_path: str, host: str | None = None, port: int | None = None) -> int:
    setup_logging()
    try:
        cfg = config_mod.load(config_path)
    except config_mod.ConfigError as e:
        print(f"slogate: {e}", file=sys.stderr)
        return 2
    if not cfg.server.access_log:
        logging.getLogger("slogate.access").setLevel(logging.WARNING)
    asyncio.run(serve(cfg, host or cfg.server.host, cfg.server.port if port is None else port))
    return 0
