"""The composition root: `build_app` wires the gateway's parts from the config, start-up and
clean-up give them their lives, and `slogate serve` runs it (one process, or a worker of N)."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

from aiohttp import web

import gateway
from gateway import config as config_mod
from gateway.admission.controller import AdmissionController
from gateway.admission.hostlocal import HostLocalState
from gateway.apis import PROVIDERS
from gateway.config import Config
from gateway.console import Console, ConsoleRecorder, Live
from gateway.edge import listener
from gateway.edge.auth import AuthPolicy
from gateway.edge.hosts import HostAllowList
from gateway.errors import SHUTDOWN, ListenError
from gateway.ops.keys import (
    ADMIN_APP_KEY,
    ADMISSION_KEY,
    AUTH_KEY,
    CONFIG_KEY,
    CONSOLE_KEY,
    DECISIONS_KEY,
    DRAINING_KEY,
    FINISHER_KEY,
    METRICS_KEY,
    OTLP_METRICS_KEY,
    PROXY_KEY,
    RECORDER_KEY,
    ROUTER_KEY,
    SHARED_KEY,
    SLO_KEY,
    TRACING_KEY,
    WORKER_KEY,
)
from gateway.ops.routes import Routes
from gateway.ops.workers import WorkerContext
from gateway.request.finish import Finisher
from gateway.request.proxy import Proxy
from gateway.request.slo import SLOPolicy
from gateway.telemetry import access_log, decisions as decision_log
from gateway.telemetry.otlp_metrics import OTLPMetrics
from gateway.telemetry.prometheus import Metrics
from gateway.telemetry.tracing import Tracing
from gateway.transport.netdiag import describe_listen_error
from gateway.transport.server import GuardedSite
from gateway.upstream.routing import Replica, Router

if TYPE_CHECKING:
    from gateway.admission.shared import SharedState

__all__ = ["ADMIN_APP_KEY", "FINISHER_KEY", "build_app", "run", "serve", "start", "start_admin"]

log = logging.getLogger("slogate")


def build_app(cfg: Config, *, tracing: Tracing | None = None,
              otlp_metrics: OTLPMetrics | None = None,
              worker: WorkerContext | None = None) -> web.Application:
    """The gateway app: the runtime policies (auth, SLO, router, admission) are built from the
    config's data, here and at start-up. `tracing`/`otlp_metrics` default to what the config
    and the standard OTEL_* variables say (tests pass their own exporters)."""
    config_mod.check_types(cfg, PROVIDERS)
    listener.install_log_redaction()
    # The body limit is enforced by ingress (with a clear error), not by aiohttp's reader.
    app = web.Application(client_max_size=cfg.server.max_body_bytes + 1)
    app[CONFIG_KEY] = cfg
    app[DRAINING_KEY] = asyncio.Event()
    app[WORKER_KEY] = worker
    app[TRACING_KEY] = tracing
    app[OTLP_METRICS_KEY] = otlp_metrics
    app[AUTH_KEY] = auth = AuthPolicy(cfg.auth)
    app[SLO_KEY] = SLOPolicy(cfg.slo)
    app[METRICS_KEY] = Metrics(cfg.slo.thresholds_s(), cfg.slo.classes,
                               [b.name for b in cfg.backends], cfg.auth.tenants())
    # The admin surface: on its own listener when [server] admin_port says so.
    admin_app = web.Application() if cfg.server.admin_port else app
    if admin_app is not app:
        app[ADMIN_APP_KEY] = admin_app
    # The live console (GET /console): fed by the finisher, reads what the gateway publishes.
    app[RECORDER_KEY] = recorder = ConsoleRecorder(cfg.slo.classes.values())
    s = cfg.server  # the console has no key: it answers only Hosts it knows (DNS rebinding)
    hosts = HostAllowList((s.host, s.admin_host, *s.console_hosts))
    # The flight recorder of admission decisions (GET /admin/decisions, the console's "why").
    app[DECISIONS_KEY] = decisions = decision_log.from_config(
        cfg.recorder, worker.index if worker is not None else None)
    app[CONSOLE_KEY] = console = Console(recorder, lambda: live(app), gateway.version(), hosts,
                                         decisions=decisions)
    console.add_routes(admin_app if cfg.server.admin_console else app)
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    Routes(app, auth).add(cfg, admin_app)
    return app


def live(app: web.Application) -> Live | None:
    """What the console shows of the running gateway (None until start-up has finished)."""
    if PROXY_KEY not in app:
        return None
    router, admission = app[ROUTER_KEY], app[ADMISSION_KEY]
    return Live([r.view() for r in router.replicas], router.models(), app[PROXY_KEY].view(),
                admission.view() if admission is not None else None)


async def startup(app: web.Application) -> None:
    """The replicas (pools, health checks), the finisher and its sinks, admission with its
    shared state (Redis, or the host's workers), and the proxy over all of them."""
    cfg, metrics, worker = app[CONFIG_KEY], app[METRICS_KEY], app[WORKER_KEY]
    replicas = [Replica(b, cfg.breaker, metrics) for b in cfg.backends]
    for r in replicas:
        r.start_health_checks()
    app[ROUTER_KEY] = router = Router(replicas)
    app[FINISHER_KEY] = finisher = Finisher(
        metrics, app[TRACING_KEY] or Tracing(cfg.telemetry),
        app[OTLP_METRICS_KEY] or OTLPMetrics(cfg.telemetry), cfg.telemetry.prometheus,
        console=app[RECORDER_KEY], decisions=app[DECISIONS_KEY])
    admission = None
    shared: SharedState | HostLocalState | None = None  # Redis, or the host's workers
    if cfg.admission.enabled:
        if cfg.admission.redis_url:
            from gateway.admission.shared import SharedState  # imports redis only if used

            redis_state = SharedState(cfg.admission, metrics)
            if worker is not None:  # without Redis, the host's share holds host-wide
                redis_state.host = worker.slot_table()
            await redis_state.start()
            shared = redis_state
        elif worker is not None:  # caps exact across this host's workers
            shared = worker.host_admission()
            await shared.start()
        admission = AdmissionController(cfg.admission, router, metrics, shared=shared)
        if shared is not None:
            shared.attach(admission)
        admission.start()
    app[SHARED_KEY] = shared
    app[ADMISSION_KEY] = admission
    app[PROXY_KEY] = Proxy(cfg, router, finisher, app[AUTH_KEY], app[SLO_KEY], admission)


async def cleanup(app: web.Application) -> None:
    admission = app.get(ADMISSION_KEY)
    if admission is not None:
        await admission.close()
    shared = app.get(SHARED_KEY)
    if shared is not None:
        await shared.close()
    await app[ROUTER_KEY].close()
    finisher = app[FINISHER_KEY]
    # Shutdown flushes over the network and blocks: keep it off the event loop.
    await asyncio.to_thread(finisher.tracing.shutdown)
    await asyncio.to_thread(finisher.otlp.shutdown)
    if finisher.decisions is not None:  # its file's last lines
        await asyncio.to_thread(finisher.decisions.close)


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
        n = len(proxy.active)
        log.warning("drain: ending %d request%s still in flight after %.0f s",
                    n, "" if n == 1 else "s", timeout_s)
        proxy.end_all(SHUTDOWN)
        while proxy.active:
            await asyncio.sleep(0.01)


async def start(app: web.Application, cfg: Config, host: str,
                port: int) -> tuple[web.AppRunner, GuardedSite]:
    """Listen with the listener limits of [server] (header deadline, idle keep-alive timeout,
    connection caps in total and per client address, descriptor budget). A worker of
    `--workers N` listens with SO_REUSEPORT and its share of the connection caps. The admin
    listener's cap (`start_admin`) is counted in the same descriptor budget."""
    s = cfg.server
    worker = app[WORKER_KEY]
    max_conns, per_client = s.max_connections, s.max_connections_per_client
    if worker is not None:
        max_conns, per_client = worker.split_connections(max_conns, per_client)
    others = sum(b.pool_size for b in cfg.backends) + (
        admin_connections(cfg, worker) if ADMIN_APP_KEY in app else 0)
    max_conns = listener.fd_budget(max_conns, others)
    if worker is None or worker.index == 0:  # said once per host
        listener.kernel_backlog(s.backlog)
    guard = listener.ConnectionGuard(max_conns, per_client, s.header_timeout_s, app[METRICS_KEY])
    return await _listen(app, cfg, host, port, guard, reuse_port=worker is not None,
                         shutdown_timeout=s.drain_timeout_s + 5)


def admin_connections(cfg: Config, worker: WorkerContext | None) -> int:
    """This process's cap on admin connections (a worker's share of admin_max_connections)."""
    cap = cfg.server.admin_max_connections
    return worker.split_connections(cap, 0)[0] if worker is not None else cap


async def start_admin(app: web.Application, cfg: Config,
                      host: str | None = None) -> tuple[web.AppRunner, GuardedSite]:
    """The admin listener ([server] admin_port, on admin_host: loopback by default): the main
    listener's header deadline and idle timeout, and a small connection cap of its own, so
    idle or trickling admin connections can take neither descriptors nor the main port's
    share of them."""
    s = cfg.server
    guard = listener.ConnectionGuard(admin_connections(cfg, app[WORKER_KEY]), 0,
                                     s.header_timeout_s, app[METRICS_KEY])
    return await _listen(app[ADMIN_APP_KEY], cfg, host or s.admin_host, s.admin_port, guard,
                         reuse_port=app[WORKER_KEY] is not None)


async def _listen(app: web.Application, cfg: Config, host: str, port: int,
                  guard: listener.ConnectionGuard, *, reuse_port: bool,
                  **kwargs: Any) -> tuple[web.AppRunner, GuardedSite]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, **kwargs,
                           **listener.runner_kwargs(cfg.server))
    await runner.setup()
    site = GuardedSite(runner, host, port, guard, reuse_port=reuse_port,
                       backlog=cfg.server.backlog)
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
    # Everything allocated so far (~46,000 objects) lives for the process: freeze it, so no
    # collection walks it; and collect the young generation only after 20,000 net allocations.
    # The request path frees everything by reference counting (tests/integration/test_hostile.py,
    # collector off), so under load no collection runs at all: measured at 64 streams for
    # 15 s, none, against 84-148 young and 1-2 full collections (150-320 ms of pauses, the
    # full ones 30-67 ms, every stream stalled) with Python's defaults; CPU per token and RSS
    # the same within noise. The price: a reference cycle on the request path would now be
    # a leak (a 1 MiB cycle per limit hit: +1,005 MiB after 1,000 hits, -0.7 MiB with the
    # defaults), which tests/system/test_limit_memory.py would catch.
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
    admin_runner = None
    if ADMIN_APP_KEY in app:  # workers share the admin port as they share the main one
        try:
            admin_runner, admin_site = await start_admin(app, cfg)
        except ListenError:
            await runner.cleanup()
            raise
        log.info("admin listener on http://%s:%d", cfg.server.admin_host, admin_site.bound_port)
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
    access_log.use(cfg.server.access_log_format)
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
