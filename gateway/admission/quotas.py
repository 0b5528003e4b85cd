"""Tenant quotas: requests and tokens per minute (token buckets), requests in flight and
requests queued.

Requests in flight: a tenant's requests from the moment admission takes them (queued or
running) to their end; with Redis the count is global (the same atomic script as a replica's
cap, key `tenant:<name>`, with the same leases). Requests queued: this gateway's queue.

Requests per minute: a bucket of `requests_per_minute` refilled continuously; a request takes
one when it reaches admission and gets it back if admission sheds it (a request the gateway
refused did not use the tenant's capacity). Tokens per minute: the same bucket over prompt +
completion tokens; admission reserves an estimate (the prompt's estimated tokens + the request's
max_tokens, or DEFAULT_OUTPUT_TOKENS) and `finished` gives back or takes the difference once the
answer's usage is known (which may leave the bucket in debt: the next request waits for it). A
request that got no completion and no usage (the upstream refused it, or it failed or was
cancelled before its first token) is charged its prompt as estimated (`charged_tokens`).

With Redis (`[admission] redis_url`) the buckets and the in-flight count are global across
gateways (atomic scripts in admission/shared.py); when Redis is unreachable each gateway
enforces `redis_share` of every quota on its own, as it does for replica caps. The queued
count is per gateway.

A refusal is a `RateLimited` (429 + Retry-After) carrying the numbers for the SDKs' rate-limit
headers.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.config import TenantPolicy
from gateway.errors import (
    OK,
    QUOTA_IN_FLIGHT,
    QUOTA_QUEUED,
    QUOTA_REQUESTS,
    QUOTA_TOKENS,
    RateLimited,
    RateLimits,
)

if TYPE_CHECKING:
    from gateway.exchange import Exchange

DEFAULT_OUTPUT_TOKENS = 256
IN_FLIGHT_PREFIX = "tenant:"  # a tenant's in-flight count in the shared state
MINUTE = 60.0


class Bucket:
    """A local token bucket of `capacity`, refilled at capacity per minute."""

    __slots__ = ("capacity", "rate", "value", "at", "clock")

    def __init__(self, capacity: int, clock: Callable[[], float]) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / MINUTE
        self.clock = clock
        self.value = self.capacity
        self.at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.value = min(self.capacity, self.value + (now - self.at) * self.rate)
        self.at = now

    def take(self, cost: float, force: bool = False) -> tuple[bool, float]:
        """Take `cost` (a negative cost gives back); refused when short, unless `force`."""
        self._refill()
        if not force and cost > 0 and self.value < cost:
            return False, self.value
        self.value = min(self.capacity, self.value - cost)
        return True, self.value


def charged_tokens(ex: Exchange, prompt_estimate: float) -> int | None:
    """What a finished request's tokens-per-minute reservation is settled against: the usage
    it reported (prompt + completion); for one that got no completion and reported nothing
    (an upstream 4xx, a failure or cancellation before its first token), its prompt as
    admission estimated it — the engine may have read it, and the reservation for its output
    comes back; None (unknown: a whole answer without usage) leaves the reservation."""
    if ex.prompt_tokens is not None or ex.completion_tokens is not None:
        return (ex.prompt_tokens or 0) + (ex.completion_tokens or 0)
    if ex.outcome != OK and not ex.token_events:
        return math.ceil(prompt_estimate)
    return None


@dataclass
class Reservation:
    """What one request took from its tenant's quotas (given back or settled at its end)."""
    tenant: str
    policy: TenantPolicy
    tokens: float = 0.0
    request: bool = False
    in_flight: bool = False
    shared_in_flight: bool = False


class TenantQuotas:
    """Every tenant's quota state in this gateway (bounded: one entry per configured tenant,
    plus `other`)."""

    def __init__(self, shared: Any = None, share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.shared = shared  # admission.shared.SharedState, or None
        self.share = share  # fraction of each quota enforced locally while Redis is down
        self.clock = clock
        self.buckets: dict[tuple[str, str], Bucket] = {}
        self.in_flight: dict[str, int] = {}
        self.queued: dict[str, int] = {}
        self.last: dict[tuple[str, str], float] = {}  # latest remaining seen (usage gauge)

    # -- admission -------------------------------------------------------------------------

    async def reserve(self, tenant: str, policy: TenantPolicy, tokens: float) -> Reservation:
        """Take one request and `tokens` from the tenant's buckets, or raise RateLimited."""
        q = policy.quotas
        res = Reservation(tenant, policy)
        if not q.any:
            return res
        if q.max_in_flight:
            if self.shared is not None:
                ok = await self.shared.try_acquire(IN_FLIGHT_PREFIX + tenant, q.max_in_flight)
            else:
                ok = self.in_flight.get(tenant, 0) < q.max_in_flight
            if not ok:
                raise RateLimited(f"Tenant '{tenant}' has {q.max_in_flight} requests in "
                                  "flight, its quota; retry when one ends.", QUOTA_IN_FLIGHT,
                                  1.0, self.limits(policy, tenant))
            self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
            res.in_flight = True
            res.shared_in_flight = self.shared is not None
        if q.requests_per_minute:
            ok, left = await self._take(tenant, "requests", q.requests_per_minute, 1.0)
            if not ok:
                self.give_back(res)
                raise RateLimited(
                    f"Tenant '{tenant}' is over its {q.requests_per_minute} requests per "
                    "minute.", QUOTA_REQUESTS, (1.0 - left) / (q.requests_per_minute / MINUTE),
                    self.limits(policy, tenant))
            res.request = True
        if q.tokens_per_minute:
            cost = min(tokens, float(q.tokens_per_minute))  # a huge one waits for a full bucket
            ok, left = await self._take(tenant, "tokens", q.tokens_per_minute, cost)
            if not ok:
                self.give_back(res)
                raise RateLimited(
                    f"Tenant '{tenant}' is over its {q.tokens_per_minute} tokens per minute "
                    f"(this request needs about {math.ceil(cost)}).", QUOTA_TOKENS,
                    (cost - left) / (q.tokens_per_minute / MINUTE), self.limits(policy, tenant))
            res.tokens = cost
        return res

    def may_queue(self, res: Reservation) -> None:
        q = res.policy.quotas.max_queued
        if q and self.queued.get(res.tenant, 0) >= q:
            self.give_back(res)
            raise RateLimited(f"Tenant '{res.tenant}' has {q} requests queued, its quota.",
                              QUOTA_QUEUED, 1.0, self.limits(res.policy, res.tenant))

    def queue_enter(self, tenant: str) -> None:
        self.queued[tenant] = self.queued.get(tenant, 0) + 1

    def queue_leave(self, tenant: str) -> None:
        self.queued[tenant] = max(0, self.queued.get(tenant, 0) - 1)

    def _end_in_flight(self, res: Reservation) -> None:
        if res.in_flight:
            self.in_flight[res.tenant] = max(0, self.in_flight.get(res.tenant, 0) - 1)
            res.in_flight = False
            if res.shared_in_flight and self.shared is not None:
                self.shared.release(IN_FLIGHT_PREFIX + res.tenant)
                res.shared_in_flight = False

    def finished(self, res: Reservation, used_tokens: int | None) -> None:
        """The request ended: its in-flight slot back, its token reservation settled against
        what it used (None: unknown, the reservation stands)."""
        self._end_in_flight(res)
        q = res.policy.quotas
        if q.tokens_per_minute and used_tokens is not None:
            self._spawn_take(res.tenant, "tokens", q.tokens_per_minute,
                             float(used_tokens) - res.tokens, force=True)
            res.tokens = float(used_tokens)

    def give_back(self, res: Reservation) -> None:
        """The request was refused or shed before any upstream work: what it took returns."""
        q = res.policy.quotas
        if res.request:
            self._spawn_take(res.tenant, "requests", q.requests_per_minute, -1.0, force=True)
            res.request = False
        if res.tokens:
            self._spawn_take(res.tenant, "tokens", q.tokens_per_minute, -res.tokens,
                             force=True)
            res.tokens = 0.0
        self._end_in_flight(res)

    # -- what the SDKs are told --------------------------------------------------------------

    def limits(self, policy: TenantPolicy, tenant: str) -> RateLimits:
        q = policy.quotas
        req_left = self.last.get((tenant, "requests"), float(q.requests_per_minute))
        tok_left = self.last.get((tenant, "tokens"), float(q.tokens_per_minute))

        def reset(limit: int, left: float) -> float:
            return (limit - left) / (limit / MINUTE) if limit else 0.0

        return RateLimits(
            requests_limit=q.requests_per_minute, requests_remaining=math.floor(req_left),
            requests_reset_s=reset(q.requests_per_minute, req_left),
            tokens_limit=q.tokens_per_minute, tokens_remaining=math.floor(tok_left),
            tokens_reset_s=reset(q.tokens_per_minute, tok_left))

    def usage(self, tenant: str, policy: TenantPolicy) -> dict[str, float]:
        """Share of each quota in use now (0..1+), for the quota-usage gauge."""
        q = policy.quotas
        out: dict[str, float] = {}
        if q.requests_per_minute:
            out["requests_per_minute"] = 1.0 - self.last.get(
                (tenant, "requests"), float(q.requests_per_minute)) / q.requests_per_minute
        if q.tokens_per_minute:
            out["tokens_per_minute"] = 1.0 - self.last.get(
                (tenant, "tokens"), float(q.tokens_per_minute)) / q.tokens_per_minute
        if q.max_in_flight:
            out["in_flight"] = self.in_flight.get(tenant, 0) / q.max_in_flight
        if q.max_queued:
            out["queued"] = self.queued.get(tenant, 0) / q.max_queued
        return out

    # -- buckets: Redis when shared, else local ------------------------------------------------

    async def _take(self, tenant: str, kind: str, limit: int, cost: float,
                    force: bool = False) -> tuple[bool, float]:
        if self.shared is not None:
            got: tuple[bool, float] | None = await self.shared.bucket(
                f"{tenant}:{kind}", limit, cost, force)
            if got is not None:
                self.last[(tenant, kind)] = got[1]
                return got
        bucket = self.buckets.get((tenant, kind))
        if bucket is None:
            cap = limit if self.shared is None else max(1, math.floor(limit * self.share))
            bucket = self.buckets[(tenant, kind)] = Bucket(cap, self.clock)
        ok, left = bucket.take(cost, force)
        self.last[(tenant, kind)] = left
        return ok, left

    def _spawn_take(self, tenant: str, kind: str, limit: int, cost: float,
                    force: bool) -> None:
        """A settlement or refund: never waits (a Redis call runs in a task)."""
        if self.shared is not None and self.shared.shared_now():
            self.shared.spawn(self._take(tenant, kind, limit, cost, force))
            return
        bucket = self.buckets.get((tenant, kind))
        if bucket is not None:
            _, self.last[(tenant, kind)] = bucket.take(cost, force)
