"""The admission controller.

For each request: estimate its prompt tokens, predict its TTFT and TPOT on every replica of its
model from that replica's load (prompt tokens admitted but not yet past first token, streams
decoding) and learned estimators, and
- admit it to the replica with the lowest predicted TTFT among those where both targets hold
  (counting the time it already waited, and that its admission slows the streams decoding
  there), with a random tie-break among near-equals so gateways do not herd, and optional
  prefix affinity so engine prefix caches hit;
- else queue it in its flow (tenant, SLO class) and dispatch the flows in weighted fair order
  (admission/fairness.py: start-time fair queueing across flows, earliest deadline first
  within one, strict priority bands with a per-class minimum share), re-evaluated whenever
  capacity frees; the first waiter in that order that cannot go yet holds the others back on
  its model, so capacity that frees goes to the flow whose turn it is;
- reject it with 429 + Retry-After as soon as its SLO is out of reach, when its tenant is over a
  quota (admission/quotas.py), or when the queue is full and its flow is the one over its share
  (otherwise the newest waiter of the flow furthest over its share is shed instead).
Each replica's concurrency is an adaptive limit (admission/limits.py) learned from upstream TTFT,
bounded by max_concurrency (with Redis, a global cap), so surplus requests wait here, where they
can be ordered, not in the engine. When no replica of the model (or of a fallback the key may
use) is available, the answer is 503 no_healthy_backend with the breaker's Retry-After.

Only what the server itself judges teaches the estimators and the limit: requests that ended
ok. A client that tightened its own deadline, left, or was shed for its own SLO teaches nothing;
a first token far later than predicted that only its tenant's requests meet is that tenant's
stall (estimator.TtftJudge), taught to neither.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from gateway.admission import engine_metrics
from gateway.admission.estimator import ReplicaEstimator, TokenCalibration
from gateway.admission.fairness import FairQueue
from gateway.admission.limits import AdaptiveLimit
from gateway.admission.preemption import (
    ClassUsage,
    Preemptible,
    Running,
    may_pause,
    may_take,
)
from gateway.admission.quotas import (
    DEFAULT_OUTPUT_TOKENS,
    Reservation,
    TenantQuotas,
    charged_tokens,
)
from gateway.admission.reserve import (
    Demand,
    holds_for,
    reserved_slots,
    slot_shares,
    under_share,
)
from gateway.admission.shed_log import ShedLog
from gateway.admission.start_time import SlotPlan, Slots, minimal_ttft_s, remaining_s
from gateway.config import OPEN_POLICY, AdmissionConfig, TenantPolicy
from gateway.errors import (
    OK,
    SHED_QUEUE_FULL,
    SHED_TTFT_INFEASIBLE,
    GatewayError,
    RateLimited,
)
from gateway.exchange import Exchange
from gateway.telemetry import durations
from gateway.telemetry.prometheus import Metrics
from gateway.timeline import now_ns
from gateway.upstream.routing import Replica, Router, no_healthy_backend

ADMITTED, QUEUED, REJECTED = "admitted", "queued", "rejected"
TIE_BAND = 0.05  # predictions within 5 % of the best are equally good: pick one at random
PROBE_INTERVAL_S = 1.0
MIN_HOLDS = 5  # requests ended on a replica before its slot releases are predicted
URGENT = 0.25  # a waiter in the last quarter of its TTFT budget may pass (_may_pass)


@dataclass(frozen=True, slots=True)
class Late:
    """How a request misses its TTFT deadline, predicted."""
    predicted_s: float  # its TTFT from received
    for_a_slot: bool  # a slot free now would have made it (its turn comes too late)


@dataclass(frozen=True, slots=True)
class LoadView:
    """What the console shows of admission's view of one replica."""
    predicted_ttft_ms: float  # for a new request of the usual size, now
    engine_waiting: float  # the engine's own queue, when its /metrics are scraped
    cap: int


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """The admission queue for the console: its size and who waits in it."""
    queued: int
    estimated_tokens: int
    by_class: dict[str, int]
    by_tenant: dict[str, int]  # the key's tenant, "(no key)" in open mode
    replicas: dict[str, LoadView]


class ReplicaLoad:
    """What this gateway has put on one replica."""

    __slots__ = ("replica", "est", "prefill_tokens", "prefilling", "decoding", "tpot_targets",
                 "cap", "engine_waiting", "engine_running", "engine_kv_usage", "avg_tokens",
                 "last_probe", "adaptive", "hold_s", "holds", "tickets", "by_class")

    def __init__(self, replica: Replica, est: ReplicaEstimator, cap: int,
                 adaptive: AdaptiveLimit | None = None) -> None:
        self.replica = replica
        self.est = est
        self.prefill_tokens = 0.0
        self.prefilling = 0
        self.decoding = 0
        # The configured TPOT targets of the classes decoding here (never a request's own
        # header: one request must not set the gate for everyone else's).
        self.tpot_targets: Counter[float] = Counter()
        self.cap = cap
        self.adaptive = adaptive
        self.hold_s = 0.0  # EWMA of how long an admitted request holds its slot
        self.holds = 0
        self.engine_waiting = 0.0  # from the engine's own /metrics, when scraped
        self.engine_running = 0.0
        self.engine_kv_usage: float | None = None
        self.avg_tokens = 500.0  # EWMA of admitted prompt tokens (for engine-reported queues)
        self.last_probe = 0.0
        self.tickets: set[Ticket] = set()  # this gateway's requests holding a slot here
        self.by_class: Counter[str] = Counter()  # ... by SLO class

    @property
    def in_flight(self) -> int:
        return self.prefilling + self.decoding

    def limit(self) -> int:
        """Requests this gateway may have here now: the adaptive limit, at most the cap."""
        return self.cap if self.adaptive is None else min(self.cap, self.adaptive.value)

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

    def view(self) -> LoadView:
        ttft = self.est.predict_ttft(self.work_ahead() + self.avg_tokens, self.decoding_now(),
                                     self.requests_ahead() + 1)
        return LoadView(round(ttft * 1e3, 1), self.engine_waiting, self.cap)

    def remaining(self, now_ns: int, tpot_s: float) -> list[tuple[float, Ticket]]:
        """Each stream in flight here, with the seconds until it frees its slot."""
        return [(remaining_s((now_ns - t.t_start) / 1e9, t.predicted_ttft_s, t.out_tokens,
                             tpot_s), t) for t in self.tickets]

    def _releases(self, now_ns: int, tpot_s: float) -> list[float]:
        """Seconds until each stream in flight here frees its slot, soonest first."""
        return sorted(r for r, _ in self.remaining(now_ns, tpot_s))

    def unproven(self) -> int:
        """Free slots above the level the engine has served unqueued (admission/limits.py):
        a request sent into one waits in the engine until a running stream ends."""
        return max(0, self.limit() - max(self.in_flight, self.served_slots()))

    def served_slots(self) -> int:
        """The slots the engine serves unqueued: the limit, or once the limit has come down
        (its level learned), at most the proven level."""
        adaptive = self.adaptive
        if adaptive is None or not adaptive.cuts:
            return self.limit()
        return min(self.limit(), max(adaptive.proven, adaptive.min_limit))

    def probe_wait_s(self, now_ns: int) -> float:
        """A request sent now: how long it waits in the engine's queue, predicted (0 unless
        its dispatch is a probe above the proven level; then until the first stream here
        ends)."""
        adaptive = self.adaptive
        if adaptive is None or not self.tickets or not adaptive.probe(self.in_flight + 1) \
                or self.holds < MIN_HOLDS:
            return 0.0
        tpot = self.est.predict_tpot(max(1.0, float(self.limit())))
        return self._releases(now_ns, tpot)[0]

    def slots(self, now_ns: int) -> Slots:
        """Its slots for the start-time prediction: those free now, and when each busy one
        frees (its stream's predicted remaining decode, at the TPOT of a full batch). A free
        slot above the proven level frees, in the engine, when the first stream ends."""
        limit = self.limit()
        free = max(0, limit - self.in_flight)
        if self.holds < MIN_HOLDS:
            # Nothing has ended here yet: how long a slot is held is a guess, and a guess
            # must not refuse anyone. Until then every slot counts as freeing at once.
            return Slots(free, [0.0] * min(limit, self.in_flight), 0.0, 0.0)
        tpot = self.est.predict_tpot(max(1.0, float(limit)))
        releases = self._releases(now_ns, tpot)
        # Above a lowered limit, the first streams to end free no slot.
        releases = releases[max(0, len(releases) - limit):]
        probes = self.unproven() if releases else 0
        if probes:
            releases = [releases[0]] * probes + releases
        first = self.est.predict_ttft(self.avg_tokens, self.decoding_now(), 0.0)
        return Slots(free - probes, releases, first, tpot)

    def min_tpot_target_s(self) -> float:
        return min(self.tpot_targets) if self.tpot_targets else math.inf

    def engine_report(self, values: dict[str, float]) -> None:
        self.engine_waiting = values.get("waiting", 0.0)
        self.engine_running = values.get("running", 0.0)
        self.engine_kv_usage = values.get("kv_usage")
        if self.adaptive is not None and self.engine_waiting > 0 and self.engine_running > 0:
            # The engine queues with this many running: its batch is full (max_num_seqs or
            # its KV cache), whoever sent them.
            self.adaptive.engine_reports(self.engine_running)

    def snapshot(self) -> dict[str, Any]:
        return {"prefill_tokens": round(self.prefill_tokens), "prefilling": self.prefilling,
                "decoding": self.decoding, "cap": self.cap, "limit": self.limit(),
                "by_class": dict(self.by_class),
                "concurrency": self.adaptive.snapshot() if self.adaptive is not None else None,
                "engine": {"waiting": self.engine_waiting, "running": self.engine_running,
                           "kv_cache_usage": self.engine_kv_usage},
                "healthy": self.replica.available(), **self.est.snapshot()}


class Ticket:
    """An admitted request's claim on a replica, from dispatch to its end."""

    __slots__ = ("ctrl", "load", "tokens", "body_bytes", "tpot_target_s", "predicted_ttft_s",
                 "work_at_dispatch", "decoding_at_dispatch", "ahead_at_dispatch", "state",
                 "decoding_sum", "shared_slot", "model", "tenant", "reservation",
                 "in_flight_at_dispatch", "t_start", "out_tokens", "predicted_wait_s",
                 "predicted_total_s", "slo_class", "engine_queued", "probe", "slow_start",
                 "priority", "preemptible", "resumed")

    def __init__(self, ctrl: AdmissionController, load: ReplicaLoad, tokens: float,
                 body_bytes: int, tpot_target_s: float, predicted_ttft_s: float,
                 shared_slot: bool, model: str = "", tenant: str = "other",
                 out_tokens: float = DEFAULT_OUTPUT_TOKENS, slo_class: str = "",
                 priority: int = 0, resumed: bool = False) -> None:
        self.ctrl = ctrl
        self.slo_class = slo_class
        self.priority = priority
        # its stream, once the proxy says it could be continued elsewhere (preemption.py)
        self.preemptible: Preemptible | None = None
        # the continuation of a preempted stream: its first token is not the answer's (the
        # estimators learn nothing from it)
        self.resumed = resumed
        self.engine_queued = False  # its first token came late: queued behind a full batch
        self.load = load
        self.model = model  # the model admission found a replica for (maybe a fallback)
        self.tenant = tenant
        self.reservation: Reservation | None = None
        self.tokens = tokens
        self.body_bytes = body_bytes
        self.tpot_target_s = tpot_target_s
        self.predicted_ttft_s = predicted_ttft_s
        self.shared_slot = shared_slot
        self.work_at_dispatch = load.work_ahead() + tokens
        self.decoding_at_dispatch = load.decoding_now()
        self.ahead_at_dispatch = load.requests_ahead()
        self.in_flight_at_dispatch = load.in_flight + 1
        # sent above the level the engine served unqueued: its queueing there is the probe's
        self.probe = load.adaptive is not None and load.adaptive.probe(load.in_flight + 1)
        self.slow_start = load.adaptive is not None and not load.adaptive.cuts
        self.t_start = ctrl.clock()
        self.decoding_sum: float | None = None  # streams decoding when its first token came
        self.out_tokens = out_tokens  # its output length as known or expected
        # What admission predicted when it decided (queue wait, and TTFT from received):
        # finish compares them with what happened.
        self.predicted_wait_s: float | None = None
        self.predicted_total_s: float | None = None
        self.state = "prefill"
        load.tickets.add(self)
        load.by_class[slo_class] += 1
        ctrl.usage.change(slo_class, 1, self.t_start / 1e9)
        load.prefill_tokens += tokens
        load.prefilling += 1
        load.avg_tokens += 0.05 * (tokens - load.avg_tokens)

    @property
    def replica(self) -> Replica:
        return self.load.replica

    def overshot(self) -> bool:
        """Was it sent in slow start above the level the limit then came down to, that level
        being one the engine has since served unqueued or the one above it (the cut lands
        just below the first slow first token: on a batch-8 engine the 9th may wait less than
        a slow sample's margin, leaving the limit at 9 with 8 proven)? Its first token may
        have waited in the engine's queue even where that wait was too short to be judged
        slow: the TTFT estimator must not learn it as the engine's speed (taught while the fit
        was still learning, it padded every request of a 280 ms class, and the engine sat
        idle for 34 s). When the levels below are slow too, the engine itself slowed: then
        it teaches."""
        adaptive = self.load.adaptive
        if adaptive is None or not self.slow_start or not adaptive.cuts:
            return False
        level = adaptive.value
        return self.in_flight_at_dispatch > level and adaptive.proven >= level - 1

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
        # the limit learns from the TTFT now, not at the end (a continuation's is no sample)
        if load.adaptive is not None and not self.resumed:
            est = load.est
            now = self.ctrl.clock()
            ttft = (now - self.t_start) / 1e9
            # A stall only this tenant's requests meet is not the engine queueing: it must not
            # bring the limit down for everyone.
            if not est.own_stall(self.work_at_dispatch, self.decoding_at_dispatch,
                                 self.ahead_at_dispatch, ttft - est.provider_queue_s,
                                 self.tenant, now / 1e9):
                # Its prefill and that of the prompts ahead of it: a short prompt behind a
                # long one is not queued.
                own = est.prefill_s(self.work_at_dispatch, self.decoding_at_dispatch)
                # Slow start, or a probe above the level the engine served unqueued,
                # overshooting the engine's batch: a first token queued behind the full
                # batch brings the limit down so that it does not recur, and the TTFT
                # estimator must not learn it as the engine's speed (its spread would refuse
                # tight classes long after). A probe teaches it only when it did not wait
                # at all: one that waited a little for a stream to end is not slow, but
                # padded with that wait, a tight class's every request was refused for
                # 20 s. A slow first token at a proven level is the engine's (it slowed),
                # and teaches both.
                slow_start = load.adaptive.cuts == 0 and self.in_flight_at_dispatch > 1
                queueing = ttft - est.provider_queue_s - own
                slow = load.adaptive.sample(queueing, self.in_flight_at_dispatch)
                self.engine_queued = (slow and slow_start) or (
                    self.probe and not load.adaptive.unqueued(queueing))
        self.ctrl.wake()

    def move(self, replica: Replica) -> None:
        """A retry went to another replica: the claim moves with it."""
        if replica is self.load.replica or self.state == "done":
            return
        if self.shared_slot and self.ctrl.shared is not None:
            self.ctrl.shared.move(self.load.replica.name, replica.name)
        self._release()
        self.load = self.ctrl.load_of(replica)
        self.t_start = self.ctrl.clock()
        self.in_flight_at_dispatch = self.load.in_flight + 1
        self.state = "prefill"
        self.load.tickets.add(self)
        self.load.by_class[self.slo_class] += 1
        self.ctrl.usage.change(self.slo_class, 1, self.t_start / 1e9)
        self.load.prefill_tokens += self.tokens
        self.load.prefilling += 1

    def _release(self) -> None:
        load = self.load
        if self in load.tickets:
            load.tickets.discard(self)
            load.by_class[self.slo_class] -= 1
            if load.by_class[self.slo_class] <= 0:
                del load.by_class[self.slo_class]
            self.ctrl.usage.change(self.slo_class, -1, self.ctrl.clock() / 1e9)
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

    def give_up(self) -> None:
        """Preempted: its slot is another request's from now (its global slot too); its
        answer's continuation gets a ticket of its own (AdmissionController.resume)."""
        self._release()
        self.state = "preempted"
        self.shared_slot = False
        self.preemptible = None

    def finish(self, ctx: Exchange) -> None:
        if self.state == "done":
            return
        preempted = self.state == "preempted"  # its continuation never got a slot
        decoding_end = self.load.decoding_now()
        self._release()
        self.state = "done"
        if not preempted and not self.resumed:
            self.ctrl.score(self, ctx)
            self.ctrl.learn(self, ctx, decoding_end)
        self.ctrl.release_shared(self)
        if self.reservation is not None:
            if ctx.outcome != OK and not ctx.t_sent:
                self.ctrl.quotas.give_back(self.reservation)
            else:
                self.ctrl.quotas.finished(self.reservation, charged_tokens(ctx, self.tokens))
        self.ctrl.wake()


class Waiter:
    __slots__ = ("flow", "deadline", "seq", "priority", "model", "tenant", "policy", "ctx",
                 "family", "tokens", "body_bytes", "prefix", "future", "t_queued", "reason",
                 "in_queue", "out_tokens", "predicted_wait_s", "predicted_total_s", "eta_s")

    def __init__(self, flow: tuple[str, str], deadline: int, seq: int, priority: int,
                 model: str, policy: TenantPolicy, ctx: Exchange, family: str, tokens: float,
                 body_bytes: int, prefix: bytes | None, t_queued: int,
                 out_tokens: float = DEFAULT_OUTPUT_TOKENS) -> None:
        self.flow = flow  # (tenant, SLO class)
        self.deadline = deadline  # its TTFT deadline (monotonic ns)
        self.seq = seq
        self.priority = priority
        self.model = model
        self.tenant = flow[0]
        self.policy = policy
        self.in_queue = True
        self.ctx = ctx
        self.family = family
        self.tokens = tokens
        self.body_bytes = body_bytes
        self.prefix = prefix
        self.future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self.t_queued = t_queued
        self.reason = ""
        self.out_tokens = out_tokens
        self.predicted_wait_s = 0.0  # at its arrival (what the decision to queue it used)
        self.predicted_total_s = 0.0  # its TTFT from received, predicted then
        self.eta_s = 0.0  # its predicted start (controller clock, s), as of the last pass

    def __lt__(self, other: Waiter) -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class AdmissionController:
    def __init__(self, cfg: AdmissionConfig, router: Router, metrics: Metrics,
                 shared: Any = None, clock: Callable[[], int] = now_ns) -> None:
        self.clock = clock  # monotonic ns, the clock of the request timeline (tests pass one)
        self.cfg = cfg
        self.router = router
        self.metrics = metrics
        self.shed_log = ShedLog()
        self.shared = shared  # admission.shared.SharedState when Redis is configured
        self.loads: dict[str, ReplicaLoad] = {}
        for r in router.replicas:
            self.load_of(r)
        self.fair = FairQueue()
        self.depth: Counter[str] = Counter()  # waiters by SLO class
        self.queued_tokens = 0.0
        self.calibration = TokenCalibration()
        self.mean_output = float(DEFAULT_OUTPUT_TOKENS)  # EWMA of completion tokens
        self._demand: dict[str, Demand] = {}  # per SLO class: its recent arrivals
        self._held_since: dict[str, float] = {}  # per model: free slots held, nobody admitted
        self.usage = ClassUsage()  # each class's slots in flight, over time (preemption.py)
        self.resuming: list[Waiter] = []  # preempted streams waiting to go on, first come
        self.quotas = TenantQuotas(shared, cfg.redis_share, clock=lambda: self.clock() / 1e9)
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._waking = False
        self._woken = False  # capacity changed during a drain: drain again when it ends
        self._closed = False
        self._drain_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def queue(self) -> list[Waiter]:
        """The waiters, in fair order (for the console and shared state; a copy)."""
        return list(self.fair.order())

    def start(self) -> None:
        """Background work: scraping engines' own load when configured."""
        if self.cfg.engine_metrics:
            for load in self.loads.values():
                self._tasks.append(asyncio.create_task(engine_metrics.scrape_forever(
                    load.replica.session, load.replica.cfg.base_url,
                    self.cfg.engine_metrics_interval_s, load.engine_report)))

    async def close(self) -> None:
        self._closed = True
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
            adaptive = (AdaptiveLimit(self.cfg.adaptive_initial, self.cfg.adaptive_min, cap,
                                      self.cfg.adaptive_tolerance)
                        if self.cfg.adaptive_concurrency else None)
            load = self.loads[replica.name] = ReplicaLoad(
                replica, ReplicaEstimator(self.cfg.forgetting), cap, adaptive)
        return load

    def room_for_hedge(self, replicas: Sequence[Replica]) -> bool:
        """May a first-token race add a request to one of these replicas? Only while nothing
        waits for admission and one of them is below its limit: a hedge must not make an
        overload worse."""
        return not self.fair and any(
            self.load_of(r).in_flight < self.load_of(r).limit() for r in replicas)

    # -- the decision ------------------------------------------------------------------------

    def _loads_for(self, ctx: Exchange, family: str,
                   models: Sequence[str]) -> tuple[str, list[ReplicaLoad]]:
        """The model to admit against: the requested one, else the first fallback the key may
        use that has a replica available to its tenant. 404 when nothing serves the model;
        503 no_healthy_backend (with the breakers' Retry-After) when nothing is available, or
        tenant_held when only this tenant is held off them (its own failures)."""
        chain = list(models) or [ctx.model or ""]
        first: list[ReplicaLoad] | None = None
        for model in chain:
            loads = [self.load_of(r) for r in self.router.replicas_for(model, family)]
            if first is None:
                first = loads
            if any(load.replica.available(ctx.tenant_label) for load in loads):
                return model, loads
        if not first:
            raise GatewayError(404, f"The model '{ctx.model}' does not exist or is not served "
                               "by this gateway.", "model_not_found", param="model")
        down = list({r.name: r for m in chain for r in self.router.replicas_for(m, family)
                     if hasattr(r, "breaker")}.values())  # each replica once, across the chain
        refusal = no_healthy_backend(ctx.model or "", down, ctx.tenant_label)
        self._decided(ctx, REJECTED, refusal.code)
        raise refusal

    async def admit(self, ctx: Exchange, family: str, body_bytes: int,
                    prefix: bytes | None, models: Sequence[str] = (),
                    output_tokens: int | None = None) -> Ticket:
        """Admit (a Ticket), queue, or refuse (GatewayError / RateLimited). `models`: the
        requested model and the fallbacks its key may use, in order."""
        model, loads = self._loads_for(ctx, family, models)
        tenant = ctx.tenant_label
        policy: TenantPolicy = ctx.policy or OPEN_POLICY
        tokens = ctx.estimated_tokens = body_bytes * self.calibration.ratio(tenant)
        try:
            res = await self.quotas.reserve(
                tenant, policy, tokens + (output_tokens or DEFAULT_OUTPUT_TOKENS))
        except RateLimited as e:
            self._decided(ctx, REJECTED, e.code)
            self.metrics.tenants.shed(tenant, e.code)
            raise
        out = float(output_tokens) if output_tokens else self.mean_output
        try:
            ticket = await self._admit(ctx, family, model, loads, tenant, policy, tokens,
                                       body_bytes, prefix, res, out)
        except BaseException:
            self.quotas.give_back(res)
            raise
        ticket.reservation = res
        self.metrics.tenants.quota_usage(tenant, self.quotas.usage(tenant, policy))
        return ticket

    async def _admit(self, ctx: Exchange, family: str, model: str, loads: list[ReplicaLoad],
                     tenant: str, policy: TenantPolicy, tokens: float, body_bytes: int,
                     prefix: bytes | None, res: Reservation,
                     out_tokens: float = DEFAULT_OUTPUT_TOKENS) -> Ticket:
        slo = ctx.target
        waited_s = (self.clock() - ctx.t_received) / 1e9
        now_s = self.clock() / 1e9
        demand = self._demand.get(slo.name)
        if demand is None:
            demand = self._demand[slo.name] = Demand(now_s, 0.0, 0.0, first_s=now_s)
        demand.arrive(now_s, policy.weight * slo.cls.weight, slo.ttft_ms / 1e3)
        if len(self.fair) or self.resuming or self._held_back(slo.name, model, loads):
            # Others are waiting: capacity that frees goes to the flow whose turn it is.
            ticket = None
            why_not = ("priority_wait" if self._higher_priority_waiting(slo.cls.priority)
                       else "fair_wait")
        else:
            ticket, why_not = await self._try(ctx, loads, tokens, body_bytes, prefix, model,
                                              out_tokens=out_tokens)
        if ticket is not None:
            return self._admitted_now(ctx, ticket, "predicted_ok", waited_s)
        ticket = self._probe(ctx, loads, tokens, body_bytes, model)
        if ticket is not None:
            self._decided(ctx, ADMITTED, "probe")
            self.fair.admitted_directly(slo.name)
            return ticket
        flow = (tenant, slo.name)
        weight = policy.weight * slo.cls.weight
        deadline = ctx.t_received + int(slo.ttft_ms * 1e6)
        waiter = Waiter(flow, deadline, next(self._seq), slo.cls.priority, model, policy, ctx,
                        family, tokens, body_bytes, prefix, self.clock(), out_tokens)
        # Its turn comes where the fair order would place it, not behind the whole queue.
        wait_s, ahead = self._arrival_start(waiter, loads, weight, slo.cls.min_share)
        waiter.predicted_wait_s = ctx.predicted_wait_s = wait_s
        waiter.eta_s = self.clock() / 1e9 + wait_s
        point, late = self._late(ctx, loads, tokens, ahead, wait_s)
        if late is not None:
            if late.for_a_slot:  # a running stream may give it its slot (preemption.py)
                ticket = self._preempt(ctx, loads, tokens, body_bytes, model, out_tokens)
                if ticket is not None:
                    return self._admitted_now(ctx, ticket, "preempted", waited_s)
            self._refuse_late(ctx, loads, tokens, wait_s, late)
        waiter.predicted_total_s = waited_s + point
        if len(self.fair) >= self.cfg.max_queue or \
                self.queued_tokens + tokens > self.cfg.max_queue_tokens:
            victim = self.fair.victim(flow, weight)
            if victim is None:
                self._reject(ctx, SHED_QUEUE_FULL, self._retry_after_s(loads, wait_s))
            else:
                self._shed(victim, SHED_QUEUE_FULL, self._retry_after_s(
                    loads, victim.eta_s - self.clock() / 1e9))
        self.quotas.may_queue(res)
        self.fair.push(waiter, weight, slo.cls.min_share)
        self.depth[slo.name] += 1
        self.quotas.queue_enter(tenant)
        self.queued_tokens += tokens
        self._decided(ctx, QUEUED, why_not)
        self._set_depth(slo.name)
        self._arm_timer()
        self.wake()
        try:
            ticket = await waiter.future
        finally:
            if not waiter.future.done():  # cancelled (the client left) while queued
                waiter.future.cancel()
            self._take_out(waiter)
            # the wait (telemetry/durations.py ADMISSION_WAIT) is recorded in finish
            ctx.t_queued, ctx.t_admitted = waiter.t_queued, self.clock()
        return ticket

    def _admitted_now(self, ctx: Exchange, ticket: Ticket, reason: str,
                      waited_s: float) -> Ticket:
        """An arrival admitted without queueing: it waits for nothing, as predicted."""
        self._decided(ctx, ADMITTED, reason)
        self.fair.admitted_directly(ctx.target.name)
        ticket.predicted_wait_s, ctx.predicted_wait_s = 0.0, 0.0
        ticket.predicted_total_s = waited_s + ticket.predicted_ttft_s
        return ticket

    async def _try(self, ctx: Exchange, loads: list[ReplicaLoad], tokens: float,
                   body_bytes: int, prefix: bytes | None, model: str = "",
                   deferred: list[tuple[Ticket, asyncio.Future[bool]]] | None = None,
                   out_tokens: float = DEFAULT_OUTPUT_TOKENS) -> tuple[Ticket | None, str]:
        """Admit now if a replica can meet both targets; else (None, why). With `deferred`
        (the queue's drain), the global slot is asked for, not awaited: the ticket and the
        answer to come go there, so one round trip to Redis serves every waiter of the pass."""
        slo = ctx.target
        waited_s = (self.clock() - ctx.t_received) / 1e9
        ttft_budget = slo.ttft_ms / 1e3 - waited_s
        tpot_target = slo.tpot_ms / 1e3
        ok: list[tuple[float, ReplicaLoad]] = []
        why = "no_capacity"
        for load in loads:
            if not load.replica.available(ctx.tenant_label):
                ctx.considered(load.replica.name, None, load.in_flight, load.limit(), "unavailable")
                continue
            if load.in_flight >= load.limit():
                why = "concurrency_cap"
                ctx.considered(load.replica.name, None, load.in_flight, load.limit(), why)
                continue
            est = load.est
            pred_ttft = est.predict_ttft(self._ahead(load) + tokens, load.decoding_now(),
                                         load.requests_ahead(), ctx.tenant_label)
            pred_ttft += load.probe_wait_s(self.clock())
            if pred_ttft + self.cfg.safety * est.ttft_spread_s(ctx.tenant_label) > ttft_budget:
                why = "ttft_wait"
                ctx.considered(load.replica.name, pred_ttft, load.in_flight, load.limit(), why)
                continue
            pred_tpot = est.predict_tpot(load.decoding_now() + 1)
            if pred_tpot > min(tpot_target, load.min_tpot_target_s()):
                why = "tpot_wait"
                ctx.considered(load.replica.name, pred_ttft, load.in_flight, load.limit(), why)
                continue
            ctx.considered(load.replica.name, pred_ttft, load.in_flight, load.limit(), "")
            ok.append((pred_ttft, load))
        while ok:
            load, pred = self._choose(ok, prefix)
            # Reserve before awaiting the global slot, so requests arriving meanwhile see this
            # one's load in their predictions. The replica-wide TPOT gate takes the class's
            # configured target, never the request's own.
            ticket = Ticket(self, load, tokens, body_bytes, slo.cls.tpot_ms / 1e3, pred,
                            self.shared is not None, model or (ctx.model or ""),
                            ctx.tenant_label, out_tokens, slo.name, slo.cls.priority)
            self._held_since.pop(model, None)  # a slot was taken: a hold's bound starts anew
            self._used(slo.name)
            if self.shared is not None and deferred is not None:
                deferred.append((ticket, asyncio.ensure_future(
                    self.shared.try_acquire(load.replica.name, load.cap))))
                return ticket, ""
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
               body_bytes: int, model: str = "") -> Ticket | None:
        """An idle replica that the model calls too slow: send one request anyway, at most
        once per PROBE_INTERVAL_S per replica. Rejected requests teach the estimator nothing,
        so a stale model would otherwise never learn the engine got faster again."""
        if self.shared is not None:
            return None  # the global slot needs an await: not worth it for a probe
        now = self.clock() / 1e9
        for load in loads:
            if (load.in_flight == 0 and load.engine_waiting == 0
                    and load.replica.available(ctx.tenant_label)
                    and now - load.last_probe >= PROBE_INTERVAL_S and not len(self.fair)):
                load.last_probe = now
                est = load.est
                return Ticket(self, load, tokens, body_bytes, ctx.target.cls.tpot_ms / 1e3,
                              est.predict_ttft(tokens, 0.0, tenant=ctx.tenant_label), False,
                              model or (ctx.model or ""), ctx.tenant_label,
                              slo_class=ctx.target.name, priority=ctx.target.cls.priority)
        return None

    def _preempt(self, ctx: Exchange, loads: list[ReplicaLoad], tokens: float,
                 body_bytes: int, model: str, out_tokens: float) -> Ticket | None:
        """A slot now for a request whose turn comes too late, taken from a running stream
        (admission/preemption.py): of a class more served than its own, of its priority band
        or a lower one, on a replica where it makes its TTFT, whose TPOT slack covers its
        pause; of those, the one with the fewest tokens to prefill again when it goes on
        (resume)."""
        if not self.cfg.preemption:
            return None
        slo = ctx.target
        self._used(slo.name)  # a slot now would make it: its class has use for slots
        now = self.clock()
        budget = slo.ttft_ms / 1e3 - (now - ctx.t_received) / 1e9
        share, _ = self._slot_shares(loads)
        if share.get(slo.name, 0.0) <= 0.0:
            return None
        usage = {slo.name: self.usage.mean(slo.name, now / 1e9)}
        weight = {c: d.weight for c, d in self._demand.items()}
        # when each stream here frees its slot, predicted: the next one to free is where a
        # preempted stream goes on
        releases = sorted((rt for load in loads if load.holds >= MIN_HOLDS
                           for rt in load.remaining(now, load.est.predict_tpot(
                               max(1.0, float(load.limit()))))), key=lambda rt: rt[0])
        best: tuple[float, float, ReplicaLoad, Ticket] | None = None
        for load in loads:
            if (not load.replica.available(ctx.tenant_label) or load.holds < MIN_HOLDS
                    # a request of ours above the level the engine serves unqueued waits in
                    # its queue, and takes the slot a preempted stream frees (the taker
                    # then waited 0.3-1 s for the next)
                    or load.in_flight > load.served_slots() or load.engine_waiting > 0):
                continue
            est = load.est
            decoding = max(0.0, load.decoding_now() - 1)  # the one it replaces stops
            pred = est.predict_ttft(self._ahead(load) + tokens, decoding, load.requests_ahead(),
                                    ctx.tenant_label)
            if pred + self.cfg.safety * est.ttft_spread_s(ctx.tenant_label) > budget:
                continue
            tpot = est.predict_tpot(max(1.0, load.decoding_now()))
            for t in load.tickets:
                hook = t.preemptible
                if hook is None or t.state != "decode" or t.priority > slo.cls.priority:
                    continue
                if t.slo_class not in usage:
                    usage[t.slo_class] = self.usage.mean(t.slo_class, now / 1e9)
                if not may_take(slo.name, t.slo_class, share, weight, usage):
                    continue
                seen = hook.streaming()
                if seen is None:
                    continue
                run = Running((now - seen.t_first_ns) / 1e9, seen.tokens, t.out_tokens,
                              t.tpot_target_s, tpot, seen.max_pause_s)
                next_free = next((r for r, other in releases if other is not t), math.inf)
                pause = next_free + est.predict_ttft(t.tokens + seen.tokens,
                                                     load.decoding_now(), 0.0)
                if may_pause(run, pause, budget):
                    # the cheapest to continue: the fewest tokens to prefill again (a long
                    # prompt's prefill slows every stream of the batch)
                    cost = t.tokens + seen.tokens
                    if best is None or cost < best[0]:
                        best = cost, pred, load, t
        if best is None:
            return None
        _, pred, load, victim = best
        hook = victim.preemptible
        assert hook is not None
        shared_slot = victim.shared_slot  # the global slot goes with the local one
        victim.give_up()
        ticket = Ticket(self, load, tokens, body_bytes, slo.cls.tpot_ms / 1e3, pred,
                        shared_slot, model or (ctx.model or ""), ctx.tenant_label, out_tokens,
                        slo.name, slo.cls.priority)
        self._held_since.pop(model, None)  # a slot was taken: a hold's bound starts anew
        self.metrics.child(self.metrics.preemptions, (slo.name, victim.slo_class)).inc()
        hook.preempt()
        return ticket

    async def resume(self, ctx: Exchange, family: str) -> Ticket:
        """A slot again for a preempted stream's continuation: the next one to free on a
        replica that can continue it, before any queued request's turn (its client has its
        first token, and waits mid-answer). Its claim (and quota) moves to the new ticket.
        Raises GatewayError when no replica of its model that can continue is available any
        more; waits until its deadline otherwise (the caller's watchdog bounds it)."""
        old = ctx.ticket
        assert isinstance(old, Ticket)
        slo = ctx.target
        waiter = Waiter((ctx.tenant_label, slo.name), ctx.t_received, next(self._seq),
                        slo.cls.priority, old.model, ctx.policy or OPEN_POLICY, ctx, family,
                        old.tokens, old.body_bytes, None, self.clock(), old.out_tokens)
        waiter.in_queue = False  # not in the fair queue: the resuming list is served first
        self.resuming.append(waiter)
        self._arm_timer()
        self.wake()
        try:
            ticket = await waiter.future
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
            if waiter in self.resuming:
                self.resuming.remove(waiter)
        ticket.reservation, old.reservation = old.reservation, None
        old.finish(ctx)  # nothing left of it but its state
        if self.shared is not None:
            # Its answer goes on whatever the global count says (the client has half of it):
            # the slot is counted when there is one.
            ticket.shared_slot = await self.shared.try_acquire(ticket.replica.name,
                                                               ticket.load.cap)
        return ticket

    def _resume_next(self) -> None:
        """Give the slots free now to the preempted streams waiting to go on, first come."""
        for waiter in list(self.resuming):
            ctx = waiter.ctx
            if waiter.future.done():
                self.resuming.remove(waiter)
                continue
            loads = [self.load_of(r) for r in self.router.replicas_for(waiter.model,
                                                                        waiter.family)
                     if r.cfg.continuation == "prefill" and r.available(ctx.tenant_label)]
            if not loads:
                waiter.future.set_exception(no_healthy_backend(waiter.model, [], ctx.tenant_label))
                self.resuming.remove(waiter)
                continue
            free = [load for load in loads if load.in_flight < load.served_slots()]
            if not free:
                continue
            load = min(free, key=lambda ld: ld.in_flight / max(1, ld.served_slots()))
            tokens = waiter.tokens + ctx.token_events  # its prompt and its answer so far
            ticket = Ticket(self, load, tokens, waiter.body_bytes,
                            ctx.target.cls.tpot_ms / 1e3,
                            load.est.predict_ttft(self._ahead(load) + tokens,
                                                  load.decoding_now(), 0.0),
                            False, waiter.model, ctx.tenant_label,
                            max(1.0, waiter.out_tokens - ctx.token_events), ctx.target.name,
                            waiter.priority, resumed=True)
            self.resuming.remove(waiter)
            waiter.future.set_result(ticket)

    def _urgent(self, waiter: Waiter) -> bool:
        """Near its deadline: strict priority would starve lower bands under sustained
        overload, so their last chance comes before the more important ones' next."""
        slo = waiter.ctx.target
        left_s = (waiter.deadline - self.clock()) / 1e9
        return bool(left_s < URGENT * slo.ttft_ms / 1e3)

    def _slipping(self, waiter: Waiter, point_s: float) -> bool:
        """Does a waiter whose turn is predicted in time have less than URGENT of its TTFT
        budget to spare beyond its own prefill (`point_s`, if it started now)?"""
        left_s = (waiter.deadline - self.clock()) / 1e9
        return left_s - point_s < URGENT * waiter.ctx.target.ttft_ms / 1e3

    def _may_pass(self, waiter: Waiter, turn_priority: int | None,
                  loads: list[ReplicaLoad]) -> bool:
        """May a waiter near its deadline pass the turn-holder (of `turn_priority`), and a
        slot held for a tighter class? From a lower priority band, yes: strict priority would
        otherwise starve it. In the same band only while its class is under its fair share of
        the slots (or none is known yet): the fair order already serves a class over its
        share its due, and under overload its queue is always full of waiters near their
        deadline — passing, they would take the slots of the classes under theirs."""
        if turn_priority is not None and waiter.priority < turn_priority:
            return True
        share, in_flight = self._slot_shares(loads)
        return not share or under_share(waiter.ctx.target.name, share, in_flight)

    def _held_back(self, cls: str, model: str, loads: list[ReplicaLoad]) -> bool:
        """Should a request of `cls` leave the model's free slots to classes under their fair
        share of the slots with a TTFT target as tight as its own or tighter (strictly
        tighter while `cls` is under its own share: admission/reserve.py)? Not once the
        slots waited their bound with nobody admitted."""
        # Only slots the engine serves unqueued count as free: one above the proven level
        # (a probe) puts its request in the engine's own queue, ahead of the next arrival
        # of the class the slots are held for, whose turn then comes when a stream ends.
        avail = [load for load in loads if load.replica.available()]
        if all(load.in_flight >= load.limit() for load in avail):
            return False
        free = sum(max(0, load.served_slots() - load.in_flight) for load in avail)
        share, in_flight = self._slot_shares(loads)
        if not share:
            return False
        reserved, bound_s = reserved_slots(cls, self._demand, share, in_flight,
                                           self.clock() / 1e9)
        if free > reserved:
            return False
        now = self.clock() / 1e9
        return now - self._held_since.setdefault(model, now) < bound_s

    def _used(self, cls: str) -> None:
        """A request of `cls` took a slot, or was refused for want of one."""
        demand = self._demand.get(cls)
        if demand is not None:
            demand.used_s = self.clock() / 1e9

    def _slot_shares(self, loads: list[ReplicaLoad]) -> tuple[dict[str, float], Counter[str]]:
        """Each class's fair share of these replicas' slots, and its slots in flight there.
        No shares until how long a slot is held is learned."""
        avail = [load for load in loads if load.replica.available()]
        in_flight: Counter[str] = Counter()
        for load in avail:
            in_flight.update(load.by_class)
        learned = [load.hold_s for load in avail if load.holds >= MIN_HOLDS]
        if not learned:
            return {}, in_flight
        # Shares of the slots the engine serves unqueued: counted over the probing limit,
        # a flooding class's share grew with each probe slot, it read as under its share,
        # and it stopped leaving slots to another class of its target (which got 46 % of
        # its share in the fairness matrix's flood cell, in flight at half its share).
        return slot_shares(self._demand, sum(load.served_slots() for load in avail),
                           sum(learned) / len(learned), self.clock() / 1e9), in_flight

    def _higher_priority_waiting(self, priority: int) -> bool:
        return self.fair.waiting_above(priority)

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

    def _best_case_s(self, loads: list[ReplicaLoad], tokens: float,
                     safety: float | None = None, tenant: str | None = None,
                     current: bool = True) -> float:
        """TTFT of a request of `tenant` on the least loaded replica once it has a slot, with
        `tokens` prefilled (its own and those starting beside it; with `current`, also the
        prefill in flight now), plus `safety` (default: the configured one) x the error its
        tenant's requests are padded with: if even that misses, waiting cannot help."""
        k = self.cfg.safety if safety is None else safety
        out = math.inf
        for load in loads:
            if not load.replica.available(tenant):
                continue
            est = load.est
            now = self._ahead(load) if current else 0.0
            out = min(out, est.predict_ttft(now + tokens, 0.0, tenant=tenant)
                      + k * est.ttft_spread_s(tenant))
        return out

    def _late(self, ctx: Exchange, loads: list[ReplicaLoad], tokens: float,
              ahead_tokens: float = 0.0, wait_s: float = 0.0) -> tuple[float, Late | None]:
        """Does even the best case miss the TTFT deadline (a 429 ttft_infeasible now, with
        Retry-After, rather than at the deadline: _refuse_late)? Its turn at a slot in `wait_s` (its
        place in the fair order, start_time.py), then its prompt prefilled beside the
        `ahead_tokens` of those starting with it. Returns the predicted TTFT from now (point,
        not padded), and how it misses (None: it is in time)."""
        waited_s = (self.clock() - ctx.t_received) / 1e9
        budget = ctx.target.ttft_ms / 1e3 - waited_s
        per_replica_ahead = ahead_tokens / max(1, len(loads))
        # The stated error pads the best case; the wait for a turn is added to the point
        # prediction only (padding both would shed requests that would have made it).
        tenant = ctx.tenant_label
        current = wait_s <= 0.0  # a later start finds today's prefill done
        point = self._best_case_s(loads, tokens + per_replica_ahead, 0.0, tenant, current)
        padded = self._best_case_s(loads, tokens + per_replica_ahead, tenant=tenant,
                                   current=current)
        if padded > budget or (wait_s and point + wait_s > budget):
            # a slot in time would have made it: it was refused for want of one
            slot = bool(wait_s) and point <= budget
            return point + wait_s, Late(waited_s + max(padded, point + wait_s), slot)
        return point + wait_s, None

    def _refuse_late(self, ctx: Exchange, loads: list[ReplicaLoad], tokens: float,
                     wait_s: float, late: Late) -> NoReturn:
        ctx.predicted_ttft_s = late.predicted_s
        if late.for_a_slot:
            self._used(ctx.target.name)
        self._reject(ctx, SHED_TTFT_INFEASIBLE, self._retry_after_s(loads, wait_s),
                     self._unreachable(ctx, loads, tokens))

    def _unreachable(self, ctx: Exchange, loads: list[ReplicaLoad], tokens: float) -> str:
        """Why a TTFT target no load level meets is refused (empty when it is reachable)."""
        avail = [load for load in loads if load.replica.available(ctx.tenant_label)]
        if not avail:
            return ""
        floor = min(minimal_ttft_s(load.est, tokens) for load in avail)
        if ctx.target.ttft_ms / 1e3 >= floor:
            return ""
        return (f" Its TTFT target is below what the backend takes for this prompt even when "
                f"idle (about {floor * 1e3:.0f} ms: prefill plus one decode step), so no load "
                "level can meet it: raise the class's ttft_ms or shorten the prompt.")

    def _retry_after_s(self, loads: list[ReplicaLoad], wait_s: float = 0.0) -> float:
        """When a request like this could be admitted: when its turn at a slot comes
        (`wait_s`, its place in the fair order), else when the prefill in flight drains on the
        least loaded replica."""
        if 0.0 < wait_s < math.inf:
            return max(1.0, wait_s)
        avail = [load for load in loads if load.replica.available()] or loads
        drain = min(load.est.predict_ttft(load.work_ahead(), load.decoding_now(),
                                          load.requests_ahead())
                    for load in avail)
        return max(1.0, drain)

    def _plan(self, loads: list[ReplicaLoad], model: str,
              tenant: str | None = None) -> SlotPlan:
        """The model's slots for the start-time prediction, the next to free going first to
        the preempted streams waiting to go on."""
        now = self.clock()
        plan = SlotPlan([load.slots(now) for load in loads if load.replica.available(tenant)])
        for w in self.resuming:
            if w.model == model and not w.future.done():
                plan.take(max(1.0, w.out_tokens - w.ctx.token_events), w.tokens)
        return plan

    def _overlap_s(self, loads: list[ReplicaLoad], tokens: float) -> float:
        """How close together two requests start and still prefill side by side."""
        return min((load.est.predict_ttft(tokens, 0.0, 0.0) for load in loads), default=0.0)

    def _arrival_start(self, arriving: Waiter, loads: list[ReplicaLoad], weight: float,
                       min_share: float) -> tuple[float, float]:
        """An arrival's predicted wait for a slot (s) where the fair order would place it, and
        the prompt tokens of the waiters ahead that start beside it."""
        plan = self._plan(loads, arriving.model, arriving.tenant)
        # An arrival under its class's share of the slots: the waiters ahead of classes with a
        # looser TTFT target, and of classes of its target over their share, leave the free
        # slots to it (reserve.py).
        cls, ttft_ms = arriving.ctx.target.name, arriving.ctx.target.ttft_ms
        share, in_flight = self._slot_shares(loads)
        reserved = under_share(cls, share, in_flight)
        for w in self.fair.order(arriving, weight, min_share):
            other = w.ctx.target
            if reserved and w is not arriving and other.name != cls and holds_for(
                    other.ttft_ms, under_share(other.name, share, in_flight), ttft_ms):
                continue
            if w is arriving:
                start = plan.take(w.out_tokens, w.tokens)
                ahead = plan.prefilling_with(start, self._overlap_s(loads, w.tokens))
                return start, ahead - w.tokens
            if w.model == arriving.model and w.in_queue and not w.future.done():
                plan.take(w.out_tokens, w.tokens)
        return 0.0, 0.0  # not reached: the order holds the arrival

    def _refusal(self, ctx: Exchange, reason: str, retry_after_s: float,
                 detail: str = "") -> GatewayError:
        self._decided(ctx, REJECTED, reason)
        self.shed_log.refused(reason)
        self.metrics.tenants.shed(ctx.tenant_label, reason)
        return GatewayError(429, f"Request not admitted ({reason}): its SLO class "
                            f"'{ctx.target.name}' (TTFT {ctx.target.ttft_ms:g} ms, TPOT "
                            f"{ctx.target.tpot_ms:g} ms) cannot be met "
                            + (f"by this backend.{detail}" if detail else "now; retry later."),
                            f"slo_{reason}", outcome="rejected",
                            headers={"Retry-After": str(math.ceil(retry_after_s)),
                                     "x-slogate-admission": reason})

    def _reject(self, ctx: Exchange, reason: str, retry_after_s: float,
                detail: str = "") -> NoReturn:
        raise self._refusal(ctx, reason, retry_after_s, detail)

    def _shed(self, waiter: Waiter, reason: str, retry_after_s: float) -> None:
        """Refuse a waiter (its admit() raises) and take it out of the queue now."""
        if not waiter.future.done():
            waiter.future.set_exception(self._refusal(waiter.ctx, reason, retry_after_s))
        self._take_out(waiter)

    def _decided(self, ctx: Exchange, decision: str, reason: str) -> None:
        ctx.admission = (decision, reason)
        if decision == ADMITTED:
            self.shed_log.admitted()
        self.metrics.child(self.metrics.admission, (ctx.model_label, ctx.route, ctx.target.name,
                                                    decision, reason)).inc()

    # -- the queue ---------------------------------------------------------------------------

    def _take_out(self, waiter: Waiter, dispatched: bool = False) -> None:
        if not waiter.in_queue:
            return
        waiter.in_queue = False
        if dispatched:
            self.fair.dispatched(waiter)
        else:
            self.fair.remove(waiter)
        self.queued_tokens -= waiter.tokens
        self.quotas.queue_leave(waiter.tenant)
        self.depth[waiter.ctx.target.name] -= 1
        self._set_depth(waiter.ctx.target.name)

    def _set_depth(self, slo_class: str) -> None:
        self.metrics.queue_depth.labels(slo_class).set(self.depth[slo_class])
        self.metrics.queued.set(len(self.fair))

    def wake(self) -> None:
        """Capacity changed: let the queue move (in a task: callers are on the hot path)."""
        if self._closed:
            return
        if self._waking:
            # A drain waiting for global slots (a Redis round trip) would miss this change
            # until the next tick.
            self._woken = True
        elif len(self.fair) or self.resuming:
            self._waking = True
            asyncio.get_running_loop().call_soon(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())  # kept: to cancel it on close

    def _arm_timer(self) -> None:
        if self._timer is None and (len(self.fair) or self.resuming):
            self._timer = asyncio.get_running_loop().call_later(0.05, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.wake()
        self._arm_timer()

    async def _drain(self) -> None:
        """Admit queued requests in fair order where they now fit; reject those whose TTFT is
        out of reach. The first waiter that must wait holds back the ones after it on the same
        model, so the next free capacity is its (unless they are in the last quarter of their
        TTFT budget and of a lower priority band, or of a class under its share: _may_pass)."""
        try:
            # per model: its slots, handed out in fair order (start_time.py)
            plans: dict[str, SlotPlan] = {}
            blocked: dict[str, int] = {}  # models whose turn-holder is waiting: its priority
            # shared state: the tickets of this pass whose global slots are being asked for
            deferred: list[tuple[Ticket, asyncio.Future[bool]]] = []
            granted: list[Waiter] = []
            self._resume_next()
            for waiter in list(self.fair.order()):
                if waiter.future.done() or not waiter.in_queue:
                    continue
                ctx = waiter.ctx
                try:
                    model, loads = self._loads_for(ctx, waiter.family,
                                                   [waiter.model, ctx.model or ""])
                except GatewayError as e:
                    waiter.future.set_exception(e)
                    self._take_out(waiter)
                    continue
                plan = plans.get(model)
                if plan is None:
                    plan = plans[model] = self._plan(loads, model)
                urgent = self._urgent(waiter) and self._may_pass(
                    waiter, blocked.get(model), loads)
                if model not in blocked and not urgent and self._held_back(
                        ctx.target.name, model, loads):
                    # it leaves the slot to a class under its share, and holds nobody back;
                    # its own turn is judged on a later pass
                    continue
                if model in blocked and not urgent:
                    ticket, why = None, "fair_wait"
                else:
                    n = len(deferred)
                    ticket, why = await self._try(ctx, loads, waiter.tokens, waiter.body_bytes,
                                                  waiter.prefix, model, deferred,
                                                  waiter.out_tokens)
                    if len(deferred) > n:
                        plan.take(waiter.out_tokens)
                        granted.append(waiter)
                        continue
                if ticket is not None:
                    plan.take(waiter.out_tokens)
                    self._dispatch(waiter, ticket)
                    continue
                # Its turn at a slot comes when the slots free that the waiters ahead of it in
                # fair order have not taken: a waiter that cannot make its deadline is told now
                # (with Retry-After), not when the deadline has passed. Under overload that
                # sheds the back of each flow, and the flows over their share have the longest
                # backs.
                wait_s = plan.take(waiter.out_tokens, waiter.tokens)
                ahead = plan.prefilling_with(wait_s, self._overlap_s(loads, waiter.tokens))
                waiter.eta_s = self.clock() / 1e9 + wait_s
                start, late = self._late(ctx, loads, waiter.tokens, ahead - waiter.tokens,
                                         wait_s)
                # Its turn comes too late, or is still to come with its deadline near (a
                # stream that runs past its predicted end is predicted to end a token later,
                # again and again): a running stream may give it its slot.
                if (late.for_a_slot if late is not None
                        else wait_s > 0 and self._slipping(waiter, start - wait_s)):
                    ticket = self._preempt(ctx, loads, waiter.tokens, waiter.body_bytes, model,
                                           waiter.out_tokens)
                    if ticket is not None:
                        self._dispatch(waiter, ticket, "preempted")
                        continue
                if late is not None:
                    try:
                        self._refuse_late(ctx, loads, waiter.tokens, wait_s, late)
                    except GatewayError as e:
                        if not waiter.future.done():
                            waiter.future.set_exception(e)
                        self._take_out(waiter)
                        continue
                blocked.setdefault(model, waiter.priority)
            for waiter, (ticket, slot) in zip(granted, deferred, strict=True):
                try:
                    ok = await slot
                except BaseException:
                    ticket.withdraw()
                    raise
                if ok:
                    self._dispatch(waiter, ticket)
                else:  # no global slot after all: it keeps its place for the next pass
                    ticket.withdraw()
        finally:
            self._waking = False
            if self._woken:
                self._woken = False
                self.wake()

    def _dispatch(self, waiter: Waiter, ticket: Ticket, reason: str = "after_queue") -> None:
        ticket.predicted_wait_s = waiter.predicted_wait_s
        ticket.predicted_total_s = waiter.predicted_total_s
        self._decided(waiter.ctx, ADMITTED, reason)
        self._take_out(waiter, dispatched=True)
        if waiter.future.done():  # cancelled meanwhile
            ticket.finish(waiter.ctx)
        else:
            waiter.future.set_result(ticket)

    # -- learning ----------------------------------------------------------------------------

    def score(self, ticket: Ticket, ctx: Exchange) -> None:
        """The admission decision's predictions against what happened (signed residuals):
        the queue wait, and the TTFT from received when a first token came."""
        if ticket.predicted_wait_s is None or ctx.slo is None:
            return  # a probe: nothing was predicted
        cls = ctx.slo.name
        waited = (ctx.t_admitted - ctx.t_queued) / 1e9 if ctx.t_queued else 0.0
        self.metrics.admission_error.observe((cls, "queue_wait"),
                                             waited - ticket.predicted_wait_s)
        if ctx.t_first_token and ticket.predicted_total_s is not None:
            ttft = (ctx.t_first_token - ctx.t_received) / 1e9
            self.metrics.admission_error.observe((cls, "ttft"), ttft - ticket.predicted_total_s)

    def learn(self, ticket: Ticket, ctx: Exchange, decoding_end: float) -> None:
        if ctx.outcome != OK or not ctx.t_sent:
            return
        if ctx.completion_tokens:
            self.mean_output += 0.05 * (ctx.completion_tokens - self.mean_output)
        load = ticket.load
        hold = (self.clock() - ticket.t_start) / 1e9
        load.hold_s = hold if not load.holds else load.hold_s + 0.1 * (hold - load.hold_s)
        load.holds += 1
        est = ticket.load.est
        if ctx.prompt_tokens:
            est.observe_prompt(ticket.body_bytes, ctx.prompt_tokens)
            self.calibration.observe(ticket.tenant, ticket.body_bytes, ctx.prompt_tokens)
        if ctx.provider_queue_s is not None:
            est.observe_provider_queue(ctx.provider_queue_s)
        if ctx.stream and ctx.t_first_token:
            actual = (ctx.t_first_token - ctx.t_sent) / 1e9
            tokens = ctx.prompt_tokens or ticket.tokens
            work = ticket.work_at_dispatch - ticket.tokens + tokens
            stall = None if ticket.engine_queued or ticket.overshot() else est.observe_ttft(
                work, ticket.decoding_at_dispatch, ticket.ahead_at_dispatch,
                actual - est.provider_queue_s, ticket.tenant, self.clock() / 1e9)
            if stall is not None:
                self.metrics.tenants.ttft_stall(ticket.tenant, stall)
            self.metrics.ttft_error.observe((ticket.replica.name, ctx.model_label),
                                            abs(actual - ticket.predicted_ttft_s))
            tpot = durations.tpot_s(ctx)
            # A client that read slower than the engine wrote paced the stream: its TPOT is
            # the client's, and would teach every tenant's admission a slow engine.
            if tpot is not None and ticket.state == "done" and not ctx.client_paused_ns:
                at_first = ticket.decoding_sum if ticket.decoding_sum is not None else decoding_end
                mean_decoding = (at_first + decoding_end) / 2
                slow = est.observe_tpot(mean_decoding, tpot, ticket.tenant, self.clock() / 1e9)
                if slow is not None:
                    self.metrics.tenants.tpot_slow(ticket.tenant, slow)

    def release_shared(self, ticket: Ticket) -> None:
        if ticket.shared_slot and self.shared is not None:
            self.shared.release(ticket.replica.name)

    def view(self) -> AdmissionView:
        waiting = self.queue
        return AdmissionView(
            len(waiting), round(self.queued_tokens),
            dict(Counter(w.ctx.target.name for w in waiting)),
            dict(Counter(w.ctx.tenant or "(no key)" for w in waiting)),
            {name: load.view() for name, load in self.loads.items()})

    def snapshot(self) -> dict[str, Any]:
        waiting = self.queue
        return {
            "enabled": True,
            "queue": {"requests": len(waiting), "estimated_tokens": round(self.queued_tokens),
                      "by_class": dict(Counter(w.ctx.target.name for w in waiting)),
                      "by_tenant": dict(Counter(w.tenant for w in waiting)),
                      "fair": self.fair.snapshot()},
            "tenants": {"tokens_per_byte": self.calibration.snapshot(),
                        "in_flight": dict(self.quotas.in_flight),
                        "queued": dict(self.quotas.queued)},
            "replicas": {name: load.snapshot() for name, load in self.loads.items()},
            "shared": self.shared.snapshot() if self.shared is not None else None,
            "classes": self._classes_snapshot(),
            "time": time.time(),
        }

    def _classes_snapshot(self) -> dict[str, Any]:
        """Each class's arrival rate, its fair share of all replicas' slots and its slots in
        flight (admission/reserve.py): why its requests were held back or passed."""
        share, in_flight = self._slot_shares(list(self.loads.values()))
        now = self.clock() / 1e9
        return {cls: {"rate_per_s": round(d.rate_at(now), 3),
                      "share_slots": round(share[cls], 2) if cls in share else None,
                      "in_flight": in_flight.get(cls, 0)}
                for cls, d in self._demand.items()}
