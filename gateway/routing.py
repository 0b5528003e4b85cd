"""Routing: which backend replica serves a model (round-robin among replicas for now)."""
from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Iterator
from urllib.parse import urlsplit

import aiohttp

import backends
from gateway.config import BackendConfig
from gateway.context import RequestContext, now_ns
from gateway.errors import GatewayError


async def _connect_start(session, trace_ctx: SimpleNamespace, params) -> None:
    ctx = trace_ctx.trace_request_ctx
    if isinstance(ctx, RequestContext):
        ctx.t_connect_start = now_ns()


async def _connect_end(session, trace_ctx: SimpleNamespace, params) -> None:
    ctx = trace_ctx.trace_request_ctx
    if isinstance(ctx, RequestContext):
        ctx.t_connect_end = now_ns()


def _connect_tracing() -> aiohttp.TraceConfig:
    """Stamps new upstream connections on the request's timeline (pool reuse costs nothing)."""
    tc = aiohttp.TraceConfig()
    tc.on_connection_create_start.append(_connect_start)
    tc.on_connection_create_end.append(_connect_end)
    return tc


class Replica:
    """One configured backend: its config and its own connection pool."""

    __slots__ = ("cfg", "session", "api_key", "address", "port")

    def __init__(self, cfg: BackendConfig, connect_timeout_s: float) -> None:
        self.cfg = cfg
        self.api_key = cfg.api_key()
        url = urlsplit(cfg.base_url)
        self.address = url.hostname or ""
        self.port = url.port or (443 if url.scheme == "https" else 80)
        connector = aiohttp.TCPConnector(limit=cfg.pool_size, limit_per_host=cfg.pool_size,
                                         enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector,
            # No total or read timeout: streams may legitimately run for minutes. Deadlines
            # are the gateway's own business (first token, idle, total), not the pool's.
            timeout=aiohttp.ClientTimeout(total=None, connect=None,
                                          sock_connect=connect_timeout_s),
            auto_decompress=True,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            trace_configs=[_connect_tracing()],
        )

    @property
    def name(self) -> str:
        return self.cfg.name

    async def close(self) -> None:
        await self.session.close()


class Router:
    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self._cycles: dict[tuple[str, str], Iterator[Replica]] = {}
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
        speaks = [r for r in self.replicas if backends.backend_type(r.cfg.type).FAMILY == family]
        named = [r for r in speaks if model in r.cfg.models or model in r.cfg.aliases]
        return named or [r for r in speaks if r.cfg.wildcard]

    def pick(self, model: str, family: str) -> tuple[Replica, str]:
        """A replica serving this model in this API family, and the model name to send
        upstream."""
        # Bounded: only configured names get their own cycle; wildcard traffic shares one.
        key = (model if model in self._known else "*", family)
        cycle = self._cycles.get(key)
        if cycle is None:
            candidates = self._candidates(model, family)
            if not candidates:
                raise GatewayError(404, f"The model '{model}' does not exist or is not served by "
                                   "this gateway.", "model_not_found", param="model")
            cycle = self._cycles[key] = itertools.cycle(candidates)
        replica = next(cycle)
        return replica, replica.cfg.aliases.get(model, model)

    async def close(self) -> None:
        for r in self.replicas:
            await r.close()
