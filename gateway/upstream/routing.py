"""Routing: the configured replicas (connection pool, health, flavour) and which of them
serves a model (round-robin among the healthy ones)."""
from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from gateway.apis import provider_for
from gateway.config import BackendConfig, BreakerPolicy
from gateway.errors import REJECTED, TENANT_HELD, GatewayError
from gateway.transport.client import Target
from gateway.transport.connector import TimedConnector
from gateway.upstream import health
from gateway.upstream.health import Breaker
from gateway.upstream.incidents import BackendLog, seconds

# At most this many backends are described in a 503 (the rest are counted).
MAX_DESCRIBED = 3


class HealthSink(Protocol):
    """What counts each replica's health (telemetry/prometheus.py's Metrics)."""

    def breaker_changed(self, backend: str, state: int) -> None: ...

    def tenant_held(self, backend: str, tenant: str) -> None: ...

    def health_checked(self, backend: str, ok: bool) -> None: ...

    def pool_full(self, backend: str) -> None: ...


class _NoSink:
    def breaker_changed(self, backend: str, state: int) -> None:
        pass

    def tenant_held(self, backend: str, tenant: str) -> None:
        pass

    def health_checked(self, backend: str, ok: bool) -> None:
        pass

    def pool_full(self, backend: str) -> None:
        pass


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the console shows of a replica (a snapshot: nothing in it is live)."""
    name: str
    address: str
    type: str
    models: tuple[str, ...]
    breaker: int  # health.CLOSED / HALF_OPEN / OPEN
    healthy: bool  # the active checks' verdict (true without them)
    available: bool
    health_checked: bool


class Replica:
    """One configured backend: its config, its own connection pool and its health."""

    __slots__ = ("cfg", "session", "api_key", "address", "port", "breaker", "healthy",
                 "provider", "_health_task", "_targets", "connector", "timeout", "sink", "log",
                 "clock", "check_failure", "unhealthy_since")

    def __init__(self, cfg: BackendConfig, breaker: BreakerPolicy,
                 sink: HealthSink | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.provider = provider_for(cfg.type, cfg.provider)
        self.api_key = cfg.api_key()
        url = urlsplit(cfg.base_url)
        self.address = url.hostname or ""
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.sink = sink = sink or _NoSink()
        self.clock = clock
        self.log = BackendLog(cfg.name, clock)  # the operator's lines (upstream/incidents.py)
        self.breaker = Breaker(breaker, lambda state: sink.breaker_changed(cfg.name, state),
                               clock, self.log,
                               on_hold=lambda tenant: sink.tenant_held(cfg.name, tenant))
        self.healthy = True  # from active checks (always true without them)
        self.check_failure = ""  # why the active check fails, in words
        self.unhealthy_since = 0.0
        self._health_task: asyncio.Task[None] | None = None
        self._targets: dict[str, Target] = {}
        self.connector = connector = TimedConnector(
            limit=cfg.pool_size, limit_per_host=cfg.pool_size,
            on_pool_full=lambda: sink.pool_full(cfg.name))
        # No total or read timeout: streams may legitimately run for minutes. Deadlines are
        # the gateway's own business (first token, idle, total), not the pool's.
        self.timeout = aiohttp.ClientTimeout(total=None, connect=None,
                                             sock_connect=cfg.timeouts.connect_s)
        # The session serves the health checks and engine-metrics scrapes; proxied requests
        # go through gateway/transport/client.py on the same connector.
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=self.timeout,
            auto_decompress=True,  # we ask for identity; a server that compresses anyway is decoded
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar(),  # an engine's cookies are not ours to keep
        )

    @property
    def name(self) -> str:
        return self.cfg.name

    def target(self, suffix: str) -> Target:
        """The upstream request's target for a path suffix (parsed once, not per request)."""
        target = self._targets.get(suffix)
        if target is None:
            target = self._targets[suffix] = Target(URL(self.cfg.base_url + suffix))
        return target

    def available(self, tenant: str | None = None) -> bool:
        """Could a request (of `tenant`; None: of anyone) go here now?"""
        return self.healthy and self.breaker.available(tenant=tenant)

    def view(self) -> ReplicaView:
        return ReplicaView(self.name, f"{self.address}:{self.port}", self.cfg.type,
                           tuple(self.cfg.models), self.breaker.state, self.healthy,
                           self.available(), bool(self.cfg.health_path))

    def start_health_checks(self) -> None:
        if self.cfg.health_path:
            parts = urlsplit(self.cfg.base_url)
            url = f"{parts.scheme}://{parts.netloc}{self.cfg.health_path}"
            self._health_task = asyncio.create_task(health.check_forever(
                url, self.cfg.health_interval_s, self.session, self._report_health))

    def _report_health(self, failure: str) -> None:
        """One active check's verdict ("" healthy, else why not): counted every time, logged
        when it changes."""
        ok = not failure
        self.sink.health_checked(self.name, ok)
        if ok and not self.healthy:
            self.log.check_recovered(self.clock() - self.unhealthy_since)
        elif not ok and self.healthy:
            self.unhealthy_since = self.clock()
            self.log.check_failed(failure)
        self.healthy, self.check_failure = ok, failure

    def why_unavailable(self, tenant: str | None = None) -> str:
        """Why no request (of `tenant`) may go here now, in words (for a 503
        no_healthy_backend)."""
        if not self.healthy:
            return (f"failing its health check for {seconds(self.clock() - self.unhealthy_since)}"
                    f": {self.check_failure}")
        return self.breaker.why_unavailable(tenant)

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.session.close()


class Router:
    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self._cands: dict[tuple[str, str], list[Replica]] = {}
        self._cycles: dict[tuple[str, str], Iterator[int]] = {}
        self._known = frozenset(self.models())

    def model_label(self, model: str) -> str:
        """The model as a metric label: configured names only, anything else is `other`."""
        return model if model in self._known else "other"

    def models(self) -> list[str]:
        """Union of the configured model names and aliases (wildcards are not listed)."""
        names: dict[str, None] = {}
        for r in self.replicas:
            for m in r.cfg.models:
                if m != "*":
                    names[m] = None
            for alias in r.cfg.aliases:
                names[alias] = None
        return list(names)

    def _candidates(self, model: str, family: str) -> list[Replica]:
        speaks = [r for r in self.replicas if r.provider.family == family]
        named = [r for r in speaks if model in r.cfg.models or model in r.cfg.aliases]
        return named or [r for r in speaks if r.cfg.wildcard]

    def replicas_for(self, model: str, family: str) -> list[Replica]:
        # Bounded: only configured names get their own entry; wildcard traffic shares one.
        key = (model if model in self._known else "*", family)
        cands = self._cands.get(key)
        if cands is None:
            cands = self._cands[key] = self._candidates(model, family)
            self._cycles[key] = itertools.cycle(range(len(cands)))
        return cands

    def pick(self, model: str, family: str, exclude: Collection[Replica] = (),
             tenant: str = "") -> tuple[Replica, str]:
        """A replica serving this model in this API family (round-robin among the healthy
        ones not in `exclude` whose breaker lets a request of `tenant` through), and the
        model name to send upstream."""
        cands = self.replicas_for(model, family)
        if not cands:
            raise GatewayError(404, f"The model '{model}' does not exist or is not served by "
                               "this gateway.", "model_not_found", param="model")
        cycle = self._cycles[(model if model in self._known else "*", family)]
        for _ in range(len(cands)):
            replica = cands[next(cycle)]
            if replica in exclude or not replica.healthy:
                continue
            if replica.breaker.acquire(tenant):
                return replica, replica.cfg.aliases.get(model, model)
        raise no_healthy_backend(model, [r for r in cands if r not in exclude], tenant)

    def unavailable_models(self) -> list[str]:
        """Configured models with no replica that could take a request now (for /readyz)."""
        out = []
        for model in self.models() or ["*"]:
            reps = [r for r in self.replicas if model in r.cfg.models or model in r.cfg.aliases
                    or (model == "*" and r.cfg.wildcard)]
            if reps and not any(r.available() for r in reps):
                out.append(model)
        return out

    async def close(self) -> None:
        for r in self.replicas:
            await r.close()


def no_healthy_backend(model: str, replicas: Sequence[Replica],
                       tenant: str | None = None) -> GatewayError:
    """503 no_healthy_backend for `model`, saying which of its backends are down and why
    (their last failure), with the soonest breaker's Retry-After. When every one of them is
    refused to this tenant only, because its own requests failed there while others'
    succeeded, it is 503 tenant_held: the tenant's own doing, not a backend down."""
    wait = min((r.breaker.retry_after_s(tenant) for r in replicas), default=1.0)
    down = [f"Backend '{r.name}' is unavailable ({r.why_unavailable(tenant)})."
            for r in replicas[:MAX_DESCRIBED]]
    if len(replicas) > MAX_DESCRIBED:
        down.append(f"{len(replicas) - MAX_DESCRIBED} more backends are unavailable.")
    headers = {"Retry-After": str(max(1, math.ceil(wait)))}
    if tenant is not None and replicas and all(r.healthy and r.breaker.held(tenant)
                                               for r in replicas):
        return GatewayError(503, " ".join([f"The model '{model}' is not served to this tenant "
                                           "right now.", *down]), TENANT_HELD,
                            outcome=REJECTED, headers=headers)
    return GatewayError(503, " ".join([f"No healthy backend for the model '{model}' right "
                                       "now.", *down]),
                        "no_healthy_backend", outcome="upstream_error", headers=headers)
