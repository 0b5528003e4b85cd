"""Routing: which backend replica serves a model (round-robin among replicas for now)."""
from __future__ import annotations

import itertools
from typing import Iterator

import aiohttp

from gateway.config import BackendConfig
from gateway.errors import GatewayError


class Replica:
    """One configured backend: its config and its own connection pool."""

    __slots__ = ("cfg", "session", "api_key")

    def __init__(self, cfg: BackendConfig, connect_timeout_s: float) -> None:
        self.cfg = cfg
        self.api_key = cfg.api_key()
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
        )

    @property
    def name(self) -> str:
        return self.cfg.name

    async def close(self) -> None:
        await self.session.close()


class Router:
    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self._cycles: dict[str, Iterator[Replica]] = {}

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

    def _candidates(self, model: str) -> list[Replica]:
        named = [r for r in self.replicas if model in r.cfg.models or model in r.cfg.aliases]
        return named or [r for r in self.replicas if r.cfg.wildcard]

    def pick(self, model: str) -> tuple[Replica, str]:
        """The replica for this model and the model name to send upstream."""
        cycle = self._cycles.get(model)
        if cycle is None:
            candidates = self._candidates(model)
            if not candidates:
                raise GatewayError(404, f"The model '{model}' does not exist or is not served by "
                                   "this gateway.", "model_not_found", param="model")
            # Bounded: only configured names get their own cycle; wildcard traffic shares one.
            key = model if any(model in r.cfg.models or model in r.cfg.aliases
                               for r in candidates) else "*"
            cycle = self._cycles.get(key)
            if cycle is None:
                cycle = self._cycles[key] = itertools.cycle(candidates)
            if key != "*":
                self._cycles[model] = cycle
        replica = next(cycle)
        return replica, replica.cfg.aliases.get(model, model)

    async def close(self) -> None:
        for r in self.replicas:
            await r.close()
