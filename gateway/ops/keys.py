"""The typed keys of what the gateway's aiohttp application holds: set by the composition root
(gateway/ops/server.py) and its start-up, read by the routes and the lifecycle."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.admission.controller import AdmissionController
from gateway.admission.hostlocal import HostLocalState
from gateway.config import Config
from gateway.console import Console, ConsoleRecorder
from gateway.edge.auth import AuthPolicy
from gateway.ops.workers import WorkerContext
from gateway.request.finish import Finisher
from gateway.request.proxy import Proxy
from gateway.request.slo import SLOPolicy
from gateway.telemetry.decisions import DecisionLog
from gateway.telemetry.otlp_metrics import OTLPMetrics
from gateway.telemetry.prometheus import Metrics
from gateway.telemetry.tracing import Tracing
from gateway.upstream.routing import Router

if TYPE_CHECKING:  # redis is imported only when Redis is configured
    from gateway.admission.shared import SharedState

CONFIG_KEY = web.AppKey("config", Config)
AUTH_KEY = web.AppKey("auth", AuthPolicy)
SLO_KEY = web.AppKey("slo", SLOPolicy)
METRICS_KEY = web.AppKey("metrics", Metrics)
DRAINING_KEY = web.AppKey("draining", asyncio.Event)
RECORDER_KEY = web.AppKey("console_recorder", ConsoleRecorder)
CONSOLE_KEY = web.AppKey("console", Console)
# the flight recorder of admission decisions (None: [recorder] enabled = false)
DECISIONS_KEY: web.AppKey[DecisionLog | None] = web.AppKey("decisions")
ADMIN_APP_KEY = web.AppKey("admin_app", web.Application)  # with [server] admin_port
# serve --workers N: this worker's place on the host (None: a single gateway)
WORKER_KEY: web.AppKey[WorkerContext | None] = web.AppKey("worker")
# the exporters a test passes in (None: what the config and OTEL_* variables say)
TRACING_KEY: web.AppKey[Tracing | None] = web.AppKey("tracing")
OTLP_METRICS_KEY: web.AppKey[OTLPMetrics | None] = web.AppKey("otlp_metrics")
# set at start-up
ROUTER_KEY = web.AppKey("router", Router)
FINISHER_KEY = web.AppKey("finisher", Finisher)
ADMISSION_KEY: web.AppKey[AdmissionController | None] = web.AppKey("admission")
SHARED_KEY: web.AppKey[SharedState | HostLocalState | None] = web.AppKey("shared_state")
PROXY_KEY = web.AppKey("proxy", Proxy)
