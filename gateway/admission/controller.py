"""The admission controller.

For each request: estimate its prompt tokens, predict its TTFT and TPOT on every replica of its
model from that replica's load (prompt tokens admitted but not yet past first token, streams
decoding) and learned estimators, and
- admit it to the replica with the lowest predicted TTFT among those where both targets hold
  (counting the time it already waited, and that its admission slows the streams decoding
  there), with a random tie-break among near-equals so gateways do not herd, and optional
  prefix affinity so engine prefix caches hit;
- else queue it — highest priority first, earliest deadline first within a priority — and
  re-evaluate whenever capacity frees;
- reject it with 429 + Retry-After as soon as its SLO is out of reach (or the queue is full).
Per-replica concurrency caps are a hard safety net; with Redis they are global.
"""
from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gateway.admission import engine_metrics
from gateway.admission.estimator import ReplicaEstimator
from gateway.config import AdmissionConfig
from gateway.errors import OK, GatewayError
from gateway.exchange import Exchange, now_ns
from gateway.routing import Replica, Router
from gateway.telemetry.prometheus import Metrics

ADMITTED, QUEUED, REJECTED = "admitted", "queued", "rejected"
TIE_BAND = 0.05  # predictions within 5 % of the best are equally good: pick one at random
PROBE_INTERVAL_S = 1.0
URGENT = 0.25  # a waiter in the last quarter of its TTFT budget may pass more important ones


class ReplicaLoad:
    """What this gateway has put on one replica."""

    __slots__ = ("replica", "est", "prefill_tokens", "prefilling", "decoding", "tpot_targets",
                 "cap", "engine_waiting", "engine_running", "engine_kv_usage", "avg_tokens",
                 "last_probe")

    def __init__(self, replica: Replica, est: ReplicaEstimator, cap: int) -> None:
        self.replica = replica
        self.est = est
        self.prefill_tokens = 0.0
        self.prefilling = 0
        self.decoding = 0
        self.tpot_targets: Counter[float] = Counter()  # TPOT targets of the streams decoding
        self.cap = cap
        self.engine_waiting = 0.0  # from the engine's own /metrics, when scraped
        self.engine_running = 0.0
        self.engine_kv_usage: float | None = None
        self.avg_tokens = 500.0  # EWMA of admitted prompt tokens (for engine-reported queues)
        self.last_probe = 0.0

    @property
    def in_flight(self) -> int:
        return self.prefilling + self.decoding

    def work_ahead(self) -> float:
        """Prompt tokens ahead of a new request: ours in prefill, plus other clients' requests
        waiting in the engine (shared engines)."""
        others = max(0.0, self.engine_waiting - self.prefilling)
        return self.prefill_tokens + others * self.avg_tokens

    def requests_ahead(self) -> float:
        """Requests ahead of a new one that have not produced their first token."""
        return self.prefilling + max(0.0, self.engine_waiting - self.prefilling)

    def decoding_now(self) -> float:
        return max(float(self.decoding), self.engine_running)

    def min_tpot_target_s(self) -> float:
        return min(self.tpot_targets) if self.tpot_targets else math.inf

    def engine_report(self, values: dict[str, float]) -> None:
        self.engine_waiting = values.get("waiting", 0.0)
        self.engine_running = values.get("running", 0.0)
        self.engine_kv_usage = values.get("kv_usage")

    def snapshot(self) -> dict[str, Any]:
        return {"prefill_tokens": round(self.prefill_tokens), "prefilling": self.prefilling,
                "decoding": self.decoding, "cap": self.cap,
                "engine": {"waiting": self.engine_waiting, "running": self.engine_running,
                           "kv_cache_usage": self.engine_kv_usage},
                "healthy": self.replica.available(), **self.est.snapshot()}


class Ticket:
    """An admitted request's claim on a replica, from dispatch to its end."""

    __slots__ = ("ctrl", "load", "tokens", "body_bytes", "tpot_target_s", "predicted_ttft_s",
                 "work_at_dispatch", "decoding_at_dispatch", "ahead_at_dispatch", "state",
                 "decoding_sum", "shared_slot")

    def __init__(self, ctrl: AdmissionController, load: ReplicaLoad, tokens: float,
                 body_bytes: int, tpot_target_s: float, predicted_ttft_s: float,
                 shared_slot: bool) -> None:
        self.ctrl = ctrl
        self.load = load
        self.tokens = tokens
        self.body_bytes = body_bytes
        self.tpot_target_s = tpot_target_s
        self.predicted_ttft_s = predicted_ttft_s
        self.shared_slot = shared_slot
        self.work_at_dispatch = load.work_ahead() + tokens
        self.decoding_at_dispatch = load.decoding_now()
        self.ahead_at_dispatch = load.requests_ahead()
        self.decoding_sum: float | None = None  # streams decoding when its first token came
        self.state = "prefill"
        load.prefill_tokens += tokens
        load.prefilling += 1
        load.avg_tokens += 0.05 * (tokens - load.avg_tokens)

    @property
    def replica(self) -> Replica:
        return self.load.replica

    def first_token(self) -> None:
        if self.state != "prefill":
            return
        load = self.load
        load.prefill_tokens -= self.tokens
        load.prefilling -= 1
        load.decoding += 1
        load.tpot_targets[self.tpot_target_s] += 1
        self.decoding_sum = load.decoding_now()
        self.state = "decode"
        self.ctrl.wake()

    def move(self, replica: Replica) -> None:
        """A retry went to another replica: the claim moves with it."""
        if replica is self.load.replica or self.state == "done":
            return
        if self.shared_slot and self.ctrl.shared is not None:
            self.ctrl.shared.move(self.load.replica.name, replica.name)
        self._release()
        self.load = self.ctrl.load_of(replica)
        self.state = "prefill"
        self.load.prefill_tokens += self.tokens
        self.load.prefilling += 1

    def _release(self) -> None:
        load = self.load
        if self.state == "prefill":
            load.prefill_tokens -= self.tokens
            load.prefilling -= 1
        elif self.state == "decode":
            load.decoding -= 1
            load.tpot_targets[self.tpot_target_s] -= 1
            if load.tpot_targets[self.tpot_target_s] <= 0:
                del load.tpot_targets[self.tpot_target_s]

    def withdraw(self) -> None:
        """Undo a reservation that did not get its global slot (nothing to learn)."""
        self._release()
        self.state = "done"

    def finish(self, ctx: Exchange) -> None:
        if self.state == "done":
            return
        decoding_end = self.load.decoding_now()
        self._release()
        self.state = "done"
        self.ctrl.learn(self, ctx, decoding_end)
        self.ctrl.release_shared(self)
        self.ctrl.wake()


class Waiter:
    __slots__ = ("key", "ctx", "family", "tokens", "body_bytes", "prefix", "future",
                 "t_queued", "reason")

    def __init__(self, key: tuple[int, int, int], ctx: Exchange, family: str, tokens: float,
                 body_bytes: int, prefix: bytes | None, t_queued: int) -> None:
        self.key = key
        self.ctx = ctx
        self.family = family
        self.tokens = tokens
        self.body_bytes = body_bytes
        self.prefix = prefix
        self.future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self.t_queued = t_queued
        self.reason = ""

    def __lt__(self, other: Waiter) -> bool:
        return self.key < other.key


class AdmissionController:
    def __init__(self, cfg: AdmissionConfig, router: Router, metrics: Metrics,
                 shared: Any = None, clock: Callable[[], int] = now_ns) -> None:
        self.clock = clock  # monotonic ns, the clock of the request timeline (tests pass one)
        self.cfg = cfg
        self.router = router
        self.metrics = metrics
        self.shared = shared  # admission.shared.SharedState when Redis is configured
        self.loads: dict[str, ReplicaLoad] = {}
        for r in router.replicas:
            self.load_of(r)
        self.queue: list[Waiter] = []
        self.queued_tokens = 0.0
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._waking = False
        self._drain_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Background work: scraping engines' own load when configured."""
        if self.cfg.engine_metrics:
            for load in self.loads.values():
                self._tasks.append(asyncio.create_task(engine_metrics.scrape_forever(
                    load.replica.session, load.replica.cfg.base_url,
                    self.cfg.engine_metrics_interval_s, load.engine_report)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._timer is not None:
            self._timer.cancel()
        if self._drain_task is not None:
            self._drain_task.cancel()

    def load_of(self, replica: Replica) -> ReplicaLoad:
        load = self.loads.get(replica.name)
        if load is None:
            cap = replica.cfg.max_concurrency or self.cfg.max_concurrency
            load = self.loads[replica.name] = ReplicaLoad(
                replica, ReplicaEstimator(self.cfg.forgetting), cap)
        return load

    # -- the decision ------------------------------------------------------------------------

    async def admit(self, ctx: Exchange, family: str, body_bytes: int,
                    prefix: bytes | None) -> Ticket:
        loads = [self.load_of(r) for r in self.router.replicas_for(ctx.model or "", family)]
        if not loads:
            raise GatewayError(404, f"The model '{ctx.model}' does not exist or is not served "
                               "by this gateway.", "model_not_found", param="model")
        tokens = body_bytes * (sum(load.est.tokens_per_byte for load in loads) / len(loads))
        if self._higher_priority_waiting(ctx.slo.cls.priority):
            # Capacity that frees goes to the more important requests already waiting.
            ticket, why_not = None, "priority_wait"
        else:
            ticket, why_not = await self._try(ctx, loads, tokens, body_bytes, prefix)
        if ticket is not None:
            self._decided(ctx, ADMITTED, "predicted_ok")
            return ticket
        ticket = self._probe(ctx, loads, tokens, body_bytes)
        if ticket is not None:
            self._decided(ctx, ADMITTED, "probe")
            return ticket
        self._check_feasible(ctx, loads, tokens, why_not)
        if len(self.queue) >= self.cfg.max_queue or \
                self.queued_tokens + tokens > self.cfg.max_queue_tokens:
            self._reject(ctx, "queue_full", self._retry_after_s(loads))
        slo = ctx.slo
        deadline = ctx.t_received + int(slo.ttft_ms * 1e6)
        waiter = Waiter((-slo.cls.priority, deadline, next(self._seq)), ctx, family, tokens,
                        body_bytes, prefix, self.clock())
        heapq.heappush(self.queue, waiter)
        self.queued_tokens += tokens
        self._decided(ctx, QUEUED, why_not)
        self._set_depth(slo.name)
        self._arm_timer()
        try:
            ticket = await waiter.future
        finally:
            if not waiter.future.done():  # cancelled (the client left) while queued
                waiter.future.cancel()
            self._remove(waiter)
            # the wait (telemetry/durations.py ADMISSION_WAIT) is recorded in finish
            ctx.t_queued, ctx.t_admitted = waiter.t_queued, self.clock()
        return ticket

    async def _try(self, ctx: Exchange, loads: list[ReplicaLoad], tokens: float,
                   body_bytes: int, prefix: bytes | None) -> tuple[Ticket | None, str]:
        """Admit now if a replica can meet both targets; else (None, why)."""
        slo = ctx.slo
        waited_s = (self.clock() - ctx.t_received) / 1e9
        ttft_budget = slo.ttft_ms / 1e3 - waited_s
        tpot_target = slo.tpot_ms / 1e3
        ok: list[tuple[float, ReplicaLoad]] = []
        why = "no_capacity"
        for load in loads:
            if not load.replica.available():
                continue
            if load.in_flight >= load.cap:
                why = "concurrency_cap"
                continue
            est = load.est
            pred_ttft = est.predict_ttft(self._ahead(load) + tokens, load.decoding_now(),
                                         load.requests_ahead())
            if pred_ttft + self.cfg.safety * est.ttft.stderr > ttft_budget:
                why = "ttft_wait"
                continue
            pred_tpot = est.predict_tpot(load.decoding_now() + 1)
            if pred_tpot > min(tpot_target, load.min_tpot_target_s()):
                why = "tpot_wait"
                continue
            ok.append((pred_ttft, load))
        while ok:
            load, pred = self._choose(ok, prefix)
            # Reserve before awaiting the global slot, so requests arriving meanwhile see this
            # one's load in their predictions.
            ticket = Ticket(self, load, tokens, body_bytes, tpot_target, pred,
                            self.shared is not None)
            if self.shared is not None and not await self.shared.try_acquire(load.replica.name,
                                                                             load.cap):
                ticket.withdraw()
                ok = [(p, other) for p, other in ok if other is not load]
                why = "concurrency_cap"
                continue
            return ticket, ""
        return None, why

    def _ahead(self, load: ReplicaLoad) -> float:
        """Prompt tokens ahead on a replica: this gateway's, other clients' (engine metrics)
        and other gateways' (shared state)."""
        ahead = load.work_ahead()
        if self.shared is not None:
            ahead += self.shared.remote_prefill_tokens(load.replica.name)
        return ahead

    def _probe(self, ctx: Exchange, loads: list[ReplicaLoad], tokens: float,
               body_bytes: int) -> Ticket | None:
        """An idle replica that the model calls too slow: send one request anyway, at most
        once per PROBE_INTERVAL_S per replica. Rejected requests teach the estimator nothing,
        so a stale model would otherwise never learn the engine got faster again."""
        if self.shared is not None:
            return None  # the global slot needs an await: not worth it for a probe
        now = self.clock() / 1e9
        for load in loads:
            if (load.in_flight == 0 and load.engine_waiting == 0 and load.replica.available()
                    and now - load.last_probe >= PROBE_INTERVAL_S and not self.queue):
                load.last_probe = now
                est = load.est
                return Ticket(self, load, tokens, body_bytes, ctx.slo.tpot_ms / 1e3,
                              est.predict_ttft(tokens, 0.0), False)
        return None

    def _urgent(self, waiter: Waiter) -> bool:
        """Near its deadline: strict priority would starve lower bands under sustained
        overload, so their last chance comes before the more important ones' next."""
        slo = waiter.ctx.slo
        left_s = (waiter.key[1] - self.clock()) / 1e9
        return bool(left_s < URGENT * slo.ttft_ms / 1e3)

    def _higher_priority_waiting(self, priority: int) -> bool:
        return any(w.key[0] < -priority and not w.future.done() for w in self.queue)

    def _choose(self, ok: list[tuple[float, ReplicaLoad]],
                prefix: bytes | None) -> tuple[ReplicaLoad, float]:
        best = min(p for p, _ in ok)
        if prefix is not None and self.cfg.prefix_affinity:
            # Rendezvous hashing: every gateway agrees on the preferred replica of a prefix.
            pred, load = max(ok, key=lambda pl: hashlib.blake2b(
                prefix + pl[1].replica.name.encode(), digest_size=8).digest())
            if pred <= best * (1 + self.cfg.affinity_slack) + 1e-3:
                return load, pred
        near = [(p, load) for p, load in ok if p <= best * (1 + TIE_BAND) + 1e-4]
        pred, load = random.choice(near)
        return load, pred

    def _best_case_s(self, loads: list[ReplicaLoad], tokens: float) -> float:
        """TTFT on the least loaded replica if the work queued ahead of it in the gateway went
        first, plus the stated error: if even that misses, waiting cannot help."""
        out = math.inf
        for load in loads:
            if not load.replica.available():
                continue
            est = load.est
            out = min(out, est.predict_ttft(self._ahead(load) + tokens, 0.0)
                      + self.cfg.safety * est.ttft.stderr)
        return out

    def _check_feasible(self, ctx: Exchange, loads: list[ReplicaLoad], tokens: float,
                        why: str, ahead_tokens: float = 0.0) -> None:
        budget = ctx.slo.ttft_ms / 1e3 - (self.clock() - ctx.t_received) / 1e9
        per_replica_ahead = ahead_tokens / max(1, len(loads))
        if self._best_case_s(loads, tokens + per_replica_ahead) > budget:
            self._reject(ctx, "ttft_infeasible", self._retry_after_s(loads))

    def _retry_after_s(self, loads: list[ReplicaLoad]) -> float:
        """When a request like this could be admitted: the time for the prefill work (ours in
        flight and queued) to drain on the least loaded replica."""
        avail = [load for load in loads if load.replica.available()] or loads
        drain = min(load.est.predict_ttft(load.work_ahead() + self.queued_tokens / len(avail),
                                          load.decoding_now(),
                                          load.requests_ahead() + len(self.queue) / len(avail))
                    for load in avail)
        return max(1.0, drain)

    def _reject(self, ctx: Exchange, reason: str, retry_after_s: float) -> None:
        self._decided(ctx, REJECTED, reason)
        raise GatewayError(429, f"Request not admitted ({reason}): its SLO class "
                           f"'{ctx.slo.name}' (TTFT {ctx.slo.ttft_ms:g} ms, TPOT "
                           f"{ctx.slo.tpot_ms:g} ms) cannot be met now; retry later.",
                           f"slo_{reason}", outcome="rejected",
                           headers={"Retry-After": str(math.ceil(retry_after_s)),
                                    "x-slogate-admission": reason})

    def _decided(self, ctx: Exchange, decision: str, reason: str) -> None:
        ctx.admission = (decision, reason)
        self.metrics.child(self.metrics.admission, (ctx.model_label, ctx.route, ctx.slo.name,
                                                    decision, reason)).inc()

    # -- the queue ---------------------------------------------------------------------------

    def _remove(self, waiter: Waiter) -> None:
        try:
            self.queue.remove(waiter)
        except ValueError:
            return
        heapq.heapify(self.queue)
        self.queued_tokens -= waiter.tokens
        self._set_depth(waiter.ctx.slo.name)

    def _set_depth(self, slo_class: str) -> None:
        n = sum(1 for w in self.queue if w.ctx.slo.name == slo_class)
        self.metrics.queue_depth.labels(slo_class).set(n)
        self.metrics.queued.set(len(self.queue))

    def wake(self) -> None:
        """Capacity changed: let the queue move (in a task: callers are on the hot path)."""
        if self.queue and not self._waking:
            self._waking = True
            asyncio.get_running_loop().call_soon(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())  # kept: to cancel it on close

    def _arm_timer(self) -> None:
        if self._timer is None and self.queue:
            self._timer = asyncio.get_running_loop().call_later(0.05, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.wake()
        self._arm_timer()

    async def _drain(self) -> None:
        """Admit queued requests in priority/deadline order where they now fit; reject those
        whose TTFT is out of reach."""
        try:
            ahead = 0.0
            blocked: int | None = None  # the priority band of the first waiter left waiting
            for waiter in sorted(self.queue):
                if waiter.future.done():
                    continue
                ctx = waiter.ctx
                loads = [self.load_of(r) for r in
                         self.router.replicas_for(ctx.model or "", waiter.family)]
                if blocked is not None and waiter.key[0] > blocked and not self._urgent(waiter):
                    ticket, why = None, "priority_wait"  # a more important one waits first
                else:
                    ticket, why = await self._try(ctx, loads, waiter.tokens, waiter.body_bytes,
                                                  waiter.prefix)
                if ticket is not None:
                    self._decided(ctx, ADMITTED, "after_queue")
                    if waiter.future.done():  # cancelled meanwhile
                        ticket.finish(ctx)
                    else:
                        waiter.future.set_result(ticket)
                    continue
                try:
                    self._check_feasible(ctx, loads, waiter.tokens, why, ahead)
                except GatewayError as e:
                    if not waiter.future.done():
                        waiter.future.set_exception(e)
                    continue
                ahead += waiter.tokens
                if blocked is None:
                    blocked = waiter.key[0]
        finally:
            self._waking = False

    # -- learning ----------------------------------------------------------------------------

    def learn(self, ticket: Ticket, ctx: Exchange, decoding_end: float) -> None:
        if ctx.outcome != OK or not ctx.t_sent:
            return
        est = ticket.load.est
        if ctx.prompt_tokens:
            est.observe_prompt(ticket.body_bytes, ctx.prompt_tokens)
        if ctx.provider_queue_s is not None:
            est.observe_provider_queue(ctx.provider_queue_s)
        if ctx.stream and ctx.t_first_token:
            actual = (ctx.t_first_token - ctx.t_sent) / 1e9
            tokens = ctx.prompt_tokens or ticket.tokens
            work = ticket.work_at_dispatch - ticket.tokens + tokens
            est.observe_ttft(work, ticket.decoding_at_dispatch, ticket.ahead_at_dispatch,
                             actual - est.provider_queue_s)
            self.metrics.ttft_error.observe((ticket.replica.name, ctx.model_label),
                                            abs(actual - ticket.predicted_ttft_s))
            tpot = ctx.tpot_s()
            if tpot is not None and ticket.state == "done":
                at_first = ticket.decoding_sum if ticket.decoding_sum is not None else decoding_end
                mean_decoding = (at_first + decoding_end) / 2
                est.observe_tpot(mean_decoding, tpot)

    def release_shared(self, ticket: Ticket) -> None:
        if ticket.shared_slot and self.shared is not None:
            self.shared.release(ticket.replica.name)

    def snapshot(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "queue": {"requests": len(self.queue), "estimated_tokens": round(self.queued_tokens),
                      "by_class": dict(Counter(w.ctx.slo.name for w in self.queue))},
            "replicas": {name: load.snapshot() for name, load in self.loads.items()},
            "shared": self.shared.snapshot() if self.shared is not None else None,
            "time": time.time(),
        }
