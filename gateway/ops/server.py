"""The gateway application: routes, lifecycle, and `slogate serve`."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client.exposition import choose_encoder

import gateway
from gateway import config as config_mod
from gateway.admission.controller import AdmissionController
from gateway.apis import LOCAL_ROUTES, PROVIDERS, ROUTES, chat, messages
from gateway.apis.base import Api, Handler
from gateway.config import Config
from gateway.console import Console, ConsoleRecorder
from gateway.edge import limits, listener
from gateway.edge.auth import AuthPolicy
from gateway.errors import SHUTDOWN, GatewayError, ListenError
from gateway.exchange import new_request_id
from gateway.ops.workers import WorkerContext
from gateway.request.finish import Finisher
from gateway.request.proxy import REQUEST_ID_HEADER, Proxy
from gateway.request.slo import SLOPolicy
from gateway.telemetry.otlp_metrics import OTLPMetrics
from gateway.telemetry.prometheus import Metrics
from gateway.telemetry.tracing import Tracing
from gateway.transport.netdiag import describe_listen_error
from gateway.upstream.routing import Replica, Router

log = logging.getLogger("slogate")
CONFIG_KEY = web.AppKey("config", Config)
ROUTER_KEY = web.AppKey("router", Router)
PROXY_KEY = web.AppKey("proxy", Proxy)
METRICS_KEY = web.AppKey("metrics", Metrics)
FINISHER_KEY = web.AppKey("finisher", Finisher)
DRAINING_KEY = web.AppKey("draining", asyncio.Event)
ADMISSION_KEY: web.AppKey[AdmissionController | None] = web.AppKey("admission")
SHARED_KEY = web.AppKey("shared_state", object)
CONSOLE_KEY = web.AppKey("console", Console)
ADMIN_APP_KEY = web.AppKey("admin_app", web.Application)  # with [server] admin_port
# serve --workers N: this worker's place on the host (None: a single gateway)
WORKER_KEY: web.AppKey[WorkerContext | None] = web.AppKey("worker")


def build_app(cfg: Config, *, tracing: Tracing | None = None,
              otlp_metrics: OTLPMetrics | None = None,
              worker: WorkerContext | None = None) -> web.Application:
    """The gateway app: the runtime policies (auth, SLO, router, admission) are built here from
    the config's data. `tracing`/`otlp_metrics` default to what the config and the standard
    OTEL_* variables say (tests pass their own exporters)."""
    config_mod.check_types(cfg, PROVIDERS)
    listener.install_log_redaction()
    # The body limit is enforced by ingress (with a clear error), not by aiohttp's reader.
    app = web.Application(client_max_size=cfg.server.max_body_bytes + 1)
    app[CONFIG_KEY] = cfg
    app[DRAINING_KEY] = asyncio.Event()
    app[WORKER_KEY] = worker
    auth = AuthPolicy(cfg.auth)
    slo = SLOPolicy(cfg.slo)
    metrics = Metrics(cfg.slo.thresholds_s(), cfg.slo.classes, [b.name for b in cfg.backends],
                      cfg.auth.tenants())
    app[METRICS_KEY] = metrics
    # The admin surface: on its own listener when [server] admin_port says so.
    admin_app = web.Application() if cfg.server.admin_port else app
    if admin_app is not app:
        app[ADMIN_APP_KEY] = admin_app
    # The live console (GET /console): fed by the finisher, reads the running gateway's state.
    recorder = ConsoleRecorder(cfg.slo.classes.values())
    console = app[CONSOLE_KEY] = Console(recorder, lambda: (
        app.get(ROUTER_KEY), app.get(PROXY_KEY), app.get(ADMISSION_KEY)), gateway.version())
    console.add_routes(admin_app if cfg.server.admin_console else app)

    async def startup(app: web.Application) -> None:
        replicas = [Replica(b, cfg.breaker, lambda name, st: metrics.breaker.labels(name).set(st))
                    for b in cfg.backends]
        for r in replicas:
            r.start_health_checks()
        router = Router(replicas)
        app[ROUTER_KEY] = router
        finisher = Finisher(metrics, tracing or Tracing(cfg.telemetry),
                            otlp_metrics or OTLPMetrics(cfg.telemetry), cfg.telemetry.prometheus,
                            console=recorder)
        app[FINISHER_KEY] = finisher
        admission = None
        shared: Any = None  # SharedState (Redis) or HostLocalState (--workers N)
        if cfg.admission.enabled:
            if cfg.admission.redis_url:
                from gateway.admission.shared import SharedState  # imports redis only if used

                shared = SharedState(cfg.admission, metrics)
                if worker is not None:  # without Redis, the host's share holds host-wide
                    shared.host = worker.slot_table()
                await shared.start()
            elif worker is not None:  # caps exact across this host's workers
                shared = worker.host_admission()
                await shared.start()
            admission = AdmissionController(cfg.admission, router, metrics, shared=shared)
            if shared is not None:
                shared.attach(admission)
            admission.start()
        app[SHARED_KEY] = shared
        app[ADMISSION_KEY] = admission
        app[PROXY_KEY] = Proxy(cfg, router, finisher, auth, slo, admission)

    async def cleanup(app: web.Application) -> None:
        admission = app.get(ADMISSION_KEY)
        if admission is not None:
            await admission.close()
        shared = app.get(SHARED_KEY)
        if shared is not None:
            await shared.close()  # type: ignore[attr-defined]
        await app[ROUTER_KEY].close()
        finisher = app[FINISHER_KEY]
        # Shutdown flushes over the network and blocks: keep it off the event loop.
        await asyncio.to_thread(finisher.tracing.shutdown)
        await asyncio.to_thread(finisher.otlp.shutdown)

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)

    async def proxied(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY_KEY].handle(request)

    def client_api(request: web.Request) -> Api:
        """The API format of a request outside the proxied routes: Anthropic's SDK always sends
        anthropic-version; everyone else gets OpenAI's."""
        return messages.API if "anthropic-version" in request.headers else chat.API

    async def models(request: web.Request) -> web.Response:
        api = client_api(request)
        try:
            key = auth.authenticate(request.headers)
        except GatewayError as e:
            return web.Response(status=e.status, content_type="application/json",
                                body=api.error_body(e.status, e.message, e.code))
        names = [m for m in request.app[ROUTER_KEY].models() if auth.allows(key, m)]
        if api is messages.API:  # ModelInfo list, as anthropic's models.list() reads it
            data: list[dict[str, Any]] = [{"type": "model", "id": m, "display_name": m,
                                           "created_at": "1970-01-01T00:00:00Z"} for m in names]
            return web.json_response({"data": data, "has_more": False,
                                      "first_id": names[0] if names else None,
                                      "last_id": names[-1] if names else None}, dumps=_dumps)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "slogate"} for m in names]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def prometheus(request: web.Request) -> web.Response:
        # OpenMetrics when the scraper asks for it: that format carries exemplars (trace ids).
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        ctx = app[WORKER_KEY]  # the main app's: this handler may serve the admin listener
        registry = app[METRICS_KEY].registry
        body = ctx.exposition(registry, encoder) if ctx is not None else encoder(registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    def admin_only(handler: Handler) -> Handler:
        """/admin/*: an admin key ([[auth.admin_keys]], hashed like the others), never a
        tenant's key; open only in open mode with no admin keys configured."""
        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                auth.authenticate_admin(request.headers)
            except GatewayError as e:
                return web.Response(status=e.status, content_type="application/json",
                                    body=chat.error_body(e.status, e.message, e.code))
            return await handler(request)
        return guarded

    async def admission_state(request: web.Request) -> web.Response:
        ctrl = app[ADMISSION_KEY]
        body = ctrl.snapshot() if ctrl is not None else {"enabled": False}
        ctx = request.app[WORKER_KEY]
        if ctx is not None:
            body = ctx.host_admission_view(body)
        return web.json_response(body, dumps=_dumps)

    async def backends_state(request: web.Request) -> web.Response:
        """Per-model and per-replica health: breakers, active checks, what is available."""
        router = app[ROUTER_KEY]
        return web.json_response(backend_health(router), dumps=_dumps)

    async def healthz(request: web.Request) -> web.Response:
        body: dict[str, Any] = {"status": "ok"}
        if request.query.get("verbose") == "1" and ROUTER_KEY in app:
            body["models_without_backend"] = app[ROUTER_KEY].unavailable_models()
        return web.json_response(body, dumps=_dumps)

    async def readyz(request: web.Request) -> web.Response:
        """This process only: listening, config loaded, not draining. A backend's health is
        not this pod's readiness (every pod would leave rotation for every model at once);
        it is in /admin/backends."""
        if app[DRAINING_KEY].is_set():
            return web.json_response({"status": "draining"}, status=503, dumps=_dumps)
        if PROXY_KEY not in app:
            return web.json_response({"status": "starting"}, status=503, dumps=_dumps)
        return web.json_response({"status": "ready"}, dumps=_dumps)

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, content_type="application/json",
                            body=client_api(request).error_body(
                                404, f"Unknown route {limits.clip(request.method, 16)} "
                                f"{limits.clip(request.path)}.",
                                "unknown_route"))

    for path in ROUTES:
        app.router.add_post(path, proxied)

    def with_id(handler: Handler) -> Handler:
        """The gateway's own answers carry a request id too (proxied ones get theirs from
        the request's context)."""
        async def wrapped(request: web.Request) -> web.StreamResponse:
            resp = await handler(request)
            if not resp.prepared:
                resp.headers.setdefault(REQUEST_ID_HEADER, new_request_id())
            return resp
        return wrapped

    for path, (method, handler) in LOCAL_ROUTES.items():
        app.router.add_route(method, path, with_id(handler))
    app.router.add_get("/v1/models", with_id(models))
    if cfg.telemetry.prometheus:
        (admin_app if cfg.server.admin_metrics else app).router.add_get(
            "/metrics", with_id(prometheus))
    admin_app.router.add_get("/admin/admission", with_id(admin_only(admission_state)))
    admin_app.router.add_get("/admin/backends", with_id(admin_only(backends_state)))
    app.router.add_get("/healthz", with_id(healthz))
    app.router.add_get("/readyz", with_id(readyz))
    _answer_wrong_methods(app, client_api)
    app.router.add_route("*", "/v1/{tail:.*}", with_id(not_found))
    return app


def backend_health(router: Router) -> dict[str, Any]:
    """What /admin/backends answers: each model's available replicas, each replica's breaker
    and active-check state."""
    states = {0: "closed", 1: "half_open", 2: "open"}
    replicas = {r.name: {"models": list(r.cfg.models), "breaker": states.get(r.breaker.state),
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


def _answer_wrong_methods(app: web.Application,
                          client_api: Callable[[web.Request], Api]) -> None:
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


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("slogate.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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
        proxy.end_all(SHUTDOWN)
        while proxy.active:
            await asyncio.sleep(0.01)


async def start(app: web.Application, cfg: Config, host: str,
                port: int) -> tuple[web.AppRunner, listener.GuardedSite]:
    """Listen with the listener limits of [server] (header deadline, idle keep-alive timeout,
    connection caps in total and per client address, descriptor budget). A worker of
    `--workers N` listens with SO_REUSEPORT and its share of the connection caps."""
    s = cfg.server
    worker = app[WORKER_KEY]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=s.drain_timeout_s + 5,
                           **listener.runner_kwargs(s))
    await runner.setup()
    max_conns, per_client = s.max_connections, s.max_connections_per_client
    if worker is not None:
        max_conns, per_client = worker.split_connections(max_conns, per_client)
    max_conns = listener.fd_budget(max_conns, sum(b.pool_size for b in cfg.backends))
    guard = listener.ConnectionGuard(max_conns, per_client, s.header_timeout_s, app[METRICS_KEY])
    site = listener.GuardedSite(runner, host, port, guard, reuse_port=worker is not None)
    try:
        await site.start()
    except OSError as e:  # one line for the user, and no unclosed upstream sessions
        await runner.cleanup()
        raise ListenError(describe_listen_error(e, host, port)) from None
    return runner, site


async def serve(cfg: Config, host: str, port: int, worker: WorkerContext | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain: /readyz turns false, listening stops after the
    readiness grace, requests in flight get the drain timeout."""
    app = build_app(cfg, worker=worker)
    runner, site = await start(app, cfg, host, port)
    # Everything allocated so far lives for the process; keep the collector off it, and
    # collect the young generation less often (the relay allocates a little per read).
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
    admin_runner = None
    if ADMIN_APP_KEY in app:
        admin_runner = web.AppRunner(app[ADMIN_APP_KEY], access_log=None)
        await admin_runner.setup()
        try:
            # Workers share the admin port as they share the main one.
            await web.TCPSite(admin_runner, host, cfg.server.admin_port,
                              reuse_port=worker is not None).start()
        except OSError as e:
            await admin_runner.cleanup()
            await runner.cleanup()
            raise ListenError(describe_listen_error(e, host, cfg.server.admin_port)) from None
        log.info("admin listener on http://%s:%d", host, cfg.server.admin_port)
    names = ", ".join(f"{b.name} ({b.base_url})" for b in cfg.backends)
    log.info("listening on http://%s:%d, backends: %s", host, port, names)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if worker is not None:
        background = _worker_tasks(app, worker, stop)
    await stop.wait()
    if worker is not None:  # a worker never outlives its supervisor's stop
        worker.exit_if_stuck(cfg.server.readiness_grace_s + cfg.server.drain_timeout_s + 10)
    log.info("draining (up to %.0f s)", cfg.server.drain_timeout_s)
    app[DRAINING_KEY].set()
    if cfg.server.readiness_grace_s:
        await asyncio.sleep(cfg.server.readiness_grace_s)
    await site.stop()  # no new connections
    await drain(app, cfg.server.drain_timeout_s)
    if admin_runner is not None:
        await admin_runner.cleanup()
    if worker is not None:
        for task in background:
            task.cancel()
        worker.publish(app[METRICS_KEY].registry, None)  # its last requests count too
    await runner.cleanup()
    log.info("stopped")


def _worker_tasks(app: web.Application, worker: WorkerContext,
                  stop: asyncio.Event) -> list[asyncio.Task[None]]:
    """A worker publishes its metrics and admission view for the host, and stops (draining)
    if its supervisor is gone."""
    def snapshot() -> dict[str, Any] | None:
        ctrl = app[ADMISSION_KEY]
        return ctrl.snapshot() if ctrl is not None else None

    async def orphaned() -> None:
        while not worker.orphaned():
            await asyncio.sleep(1.0)
        log.warning("worker %d: supervisor gone; draining", worker.index)
        stop.set()

    return [asyncio.create_task(worker.publish_forever(app[METRICS_KEY].registry, snapshot)),
            asyncio.create_task(orphaned())]


def run(config_path: str, host: str | None = None, port: int | None = None,
        workers: int | None = None, worker: str | None = None) -> int:
    """`slogate serve`: one gateway, or (workers > 1; None: the config's `[server] workers`)
    the supervisor of N workers (gateway/ops/workers.py); `worker` is the supervisor's spec for
    one of them."""
    setup_logging()
    try:
        cfg = config_mod.load(config_path, providers=PROVIDERS)
    except config_mod.ConfigError as e:
        print(f"slogate: {e}", file=sys.stderr)
        return 2
    if not cfg.server.access_log:
        logging.getLogger("slogate.access").setLevel(logging.WARNING)
    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    if workers is None:
        from gateway.ops.workers import parse_workers

        workers = parse_workers(str(cfg.server.workers))
    if workers > 1 and worker is None:
        from gateway.ops.workers import supervise

        return supervise(config_path, host, port, workers, cfg.server.drain_timeout_s,
                         cfg.server.readiness_grace_s)
    ctx = WorkerContext.parse(worker) if worker is not None else None
    if ctx is not None:
        ctx.label_logs()
    try:
        asyncio.run(serve(cfg, host, port, ctx))
    except ListenError as e:
        print(f"slogate: {e}", file=sys.stderr)
        return 2
    return 0
