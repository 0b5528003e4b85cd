"""The proxy: each request's life as named phases, in request order, with one `Exchange`
threaded through all of them (Cloudflare Pingora's `ProxyHttp` phases are the model):

    authenticate → classify → read → admit → choose_replica → send_upstream → relay → finish

A failure before commit (connect error, retryable status, first-token deadline, upstream closed
before the first token, an error in band before it, a prompt too long for the model's context)
is not a second code path: the failed `Attempt` is recorded on the exchange and the request goes
back to `choose_replica` — at once to a replica or fallback not tried yet, after the upstream's
Retry-After or a jittered backoff to one already tried — within the attempt limit and the retry
budget.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from gateway.apis import ROUTES, failures
from gateway.apis.base import Splice
from gateway.edge import ingress, limits
from gateway.edge.headers import client_response_headers, upstream_request_headers
from gateway.errors import (
    ATTEMPT_CONTEXT_LENGTH,
    ATTEMPT_CUT,
    ATTEMPT_HEDGE_LOST,
    ATTEMPT_IN_BAND_ERROR,
    ATTEMPT_OK,
    ATTEMPT_STALLED,
    CLIENT_CANCELLED,
    CONNECT_ERROR,
    FIRST_TOKEN,
    GATEWAY_ERROR,
    IDLE,
    INVALID_RESPONSE,
    NO_ANSWER,
    NOT_STREAMED,
    OK,
    PREEMPTED,
    SHUTDOWN,
    TIMEOUT,
    TOTAL,
    UPSTREAM_ERROR,
    UPSTREAM_TRUNCATED,
    AttemptFailed,
    ClientGone,
    GatewayError,
    RateLimited,
    ResponseTooLarge,
    StreamBroken,
    UpstreamInvalid,
    UpstreamLost,
    UpstreamUnreachable,
    deadline_failure,
)
from gateway.exchange import Attempt, Exchange
from gateway.request.deadlines import DeadlineOverrides, Watchdog
from gateway.request.hedge import (
    ABANDONED,
    FAILED,
    LOST,
    PRIMARY,
    SKIP_NO_REPLICA,
    SKIP_SATURATED,
    WON,
    FirstTokenProbe,
    Handover,
    Hedging,
    Race,
)
from gateway.request.preempt import PreemptibleStream
from gateway.request.relay import Relay, end_as_said, end_with_error
from gateway.telemetry.tracing import CAPTURE_LIMIT
from gateway.timeline import now_ns
from gateway.transport import client as upstream
from gateway.transport.client import UpstreamResponse
from gateway.transport.connector import CONNECTING

if TYPE_CHECKING:
    from gateway.admission.controller import AdmissionController
    from gateway.apis.base import Api
    from gateway.config import Config
    from gateway.edge.auth import AuthPolicy
    from gateway.request.finish import Finisher
    from gateway.request.slo import SLOPolicy
    from gateway.upstream.routing import Replica, Router

REQUEST_ID_HEADER = "x-slogate-request-id"
# How a committed answer that did not complete can be the backend's doing (its breaker hears).
BACKEND_FAULTS = frozenset((ATTEMPT_CUT, ATTEMPT_STALLED, ATTEMPT_IN_BAND_ERROR,
                            limits.EVENT_TOO_LARGE))
# Upstream error bodies are passed through; bounded so a misbehaving upstream cannot make us
# hold an unbounded body.
MAX_ERROR_BODY = 1024 * 1024
ADMISSION_OFF = ("admitted", "admission_off")  # every request's decision without admission


@dataclass(frozen=True, slots=True)
class RequestsView:
    """The requests in progress, counted for the console: sent upstream per backend (and of
    those, still awaiting their first token), and not yet sent, per SLO class."""
    in_flight: dict[str, int]
    awaiting_first_token: dict[str, int]
    gateway_queue: dict[str, int]


class Proxy:
    def __init__(self, cfg: Config, router: Router, finisher: Finisher, auth: AuthPolicy,
                 slo: SLOPolicy, admission: AdmissionController | None = None) -> None:
        self.cfg = cfg
        self.router = router
        self.admission = admission
        self.auth = auth
        self.slo = slo
        self.retry = cfg.retry
        self.finisher = finisher
        self.metrics = finisher.metrics
        self.gap_bounds_ns = self.metrics.itl.bounds_ns  # stream gaps counted in its buckets
        self.tracing = finisher.tracing
        self.hold_until_first_token = cfg.server.commit == "first_token"
        self.active: set[Watchdog] = set()  # requests in flight (for the drain)
        # The models some backend can continue a broken stream of ("*": any)
        self.prefill_models = frozenset(
            m for b in cfg.backends if b.continuation == "prefill" for m in (*b.models, *b.aliases))
        # First-token races, for the classes that ask (they need the commit held for a token)
        self.hedging = (Hedging(cfg, self.metrics) if self.hold_until_first_token and any(
            c.hedge_after_ms is not None for c in cfg.slo.classes.values()) else None)

    def view(self) -> RequestsView:
        in_flight: Counter[str] = Counter()
        waiting: Counter[str] = Counter()
        queued: Counter[str] = Counter()
        for watchdog in self.active:
            ctx = watchdog.ctx
            if ctx.t_sent and ctx.backend:
                in_flight[ctx.backend] += 1
                if not ctx.t_first_token:
                    waiting[ctx.backend] += 1
            else:
                queued[ctx.slo.name if ctx.slo is not None else "none"] += 1
        return RequestsView(dict(in_flight), dict(waiting), dict(queued))

    def end_all(self, reason: str) -> None:
        """End every request in flight now (drain deadline): streams get an error event."""
        for watchdog in list(self.active):
            watchdog.fire(reason)

    # -- the conductor ---------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Run one request through its phases; answer every failure in the client's API
        format; always finish."""
        api, _, operation = ROUTES[request.path]
        ex = Exchange(request.path, self.gap_bounds_ns)
        ex.api, ex.operation = api, operation
        self.metrics.in_flight.inc()
        watchdog: Watchdog | None = None
        try:
            self.authenticate(ex, request)
            overrides = self.classify(ex, request)
            await self.read(ex, request)
            watchdog = self.start_deadlines(ex, request, overrides)
            await self.admit(ex, watchdog)
            return await self.forward(ex, request, watchdog, overrides)
        except GatewayError as e:
            ex.finish(e.outcome, e.code)
            ex.status = e.status
            return self.error_response(ex, e)
        except (asyncio.CancelledError, ClientGone):
            reason = watchdog.claim() if watchdog is not None else None
            if reason is not None and not ex.t_committed:  # e.g. while queued for admission
                failure = deadline_failure(reason)
                ex.finish(TIMEOUT, failure.code)
                ex.status = failure.status
                return self.error_response(ex, failure.as_gateway_error())
            if ex.outcome is None:  # decided already: the answer was complete (not cancelled)
                ex.cancel_phase = ex.phase()
                ex.finish(CLIENT_CANCELLED)
                if ex.attempt is not None:
                    ex.attempt.close()  # the engine must see the disconnect now
            raise
        except Exception as e:  # a bug of ours: answer cleanly, keep serving
            ex.finish(GATEWAY_ERROR, type(e).__name__)
            request.app.logger.exception("internal error on %s", request.path)
            if ex.t_committed:
                raise  # the response has begun; aiohttp closes the connection
            return self.error_response(ex, GatewayError(
                500, "Internal gateway error.", "gateway_error", outcome=GATEWAY_ERROR))
        finally:
            if watchdog is not None:
                watchdog.stop()
                self.active.discard(watchdog)
            self.finish(ex)

    # -- the phases, in request order ------------------------------------------------------------

    def authenticate(self, ex: Exchange, request: web.Request) -> None:
        """Key → tenant and its policy. May refuse (401). Hands on `ex.key`, `ex.tenant`,
        `ex.tenant_label` (bounded) and `ex.policy`."""
        ex.key = self.auth.authenticate(request.headers)
        if ex.key is not None:
            ex.tenant = ex.key.tenant
        ex.tenant_label = self.auth.tenant_label(ex.key)
        ex.policy = self.auth.policy(ex.key)

    def classify(self, ex: Exchange, request: web.Request) -> DeadlineOverrides:
        """The SLO target and the deadline overrides the request asked for, each parsed once,
        bounded and checked against the tenant's policy: a class its key may not use, or an
        override it may not send, is a 403 naming what it may. May refuse (400, 403). Hands on
        `ex.slo` and the overrides."""
        ex.slo = self.slo.target_for(ex.route, request.headers, ex.tenant_policy)
        return DeadlineOverrides.from_headers(request.headers, ex.tenant_policy.timeout_overrides)

    async def read(self, ex: Exchange, request: web.Request) -> None:
        """The body (bounded) and the few fields the gateway needs: model, stream. May refuse
        (413, 400, 403 for a model the key may not use). Hands on `ex.body`, `ex.parsed`,
        `ex.model`, `ex.stream`."""
        ex.body = await ingress.read_body(request, self.cfg.server.max_body_bytes,
                                          self.cfg.server.body_timeout_s)
        ex.t_body = now_ns()
        ex.parsed = ingress.parse_json(ex.body)
        ex.model = ingress.model_of(ex.parsed)
        self.auth.authorize(ex.key, ex.model)
        ex.model_label = self.router.model_label(ex.model)
        ex.stream = ingress.stream_of(ex.parsed)

    def start_deadlines(self, ex: Exchange, request: web.Request,
                        overrides: DeadlineOverrides) -> Watchdog:
        """Arm the request's total deadline (from its model's first backend, tightened by the
        request) and start its spans. Hands on the Watchdog."""
        api = self._api(ex)
        first = self.router.replicas_for(ex.model or "", api.family)
        timeouts = overrides.apply(first[0].cfg.timeouts if first
                                   else self.cfg.backends[0].timeouts)
        if self.tracing.enabled:
            self.tracing.start(ex, request.headers, ex.operation)
        watchdog = Watchdog(ex, ex.t_received + int(timeouts.total_s * 1e9), timeouts.idle_s,
                            first_check_s=timeouts.first_token_s if ex.stream
                            else timeouts.total_s)
        self.active.add(watchdog)
        ex.retry_budget_at = ex.t_received + int(
            (self.retry.budget_s or 2 * timeouts.first_token_s) * 1e9)
        return watchdog

    async def admit(self, ex: Exchange, watchdog: Watchdog) -> None:
        """Admission control: admit now, queue, or refuse (429 with Retry-After). Hands on
        `ex.ticket` (the replica admission chose), or nothing when admission is off. A stream
        that could be continued is admission's to preempt (admission/preemption.py)."""
        if self.admission is None:
            ex.admission = ADMISSION_OFF  # counted in finish: nothing the send needs
            return
        api = self._api(ex)
        ticket = await self.admission.admit(
            ex, api.family, len(ex.body),
            api.prefix_key(ex.parsed, self.cfg.admission.prefix_bytes),
            self._model_chain(ex), ingress.max_output_tokens(ex.parsed))
        if self.prefill_models and ex.stream and api.continues:
            ticket.preemptible = PreemptibleStream(ex, watchdog, self._may_continue)
        ex.ticket = ticket
        ex.on_first_token = ticket.first_token

    async def forward(self, ex: Exchange, request: web.Request, watchdog: Watchdog,
                      overrides: DeadlineOverrides) -> web.StreamResponse:
        """choose_replica → send_upstream → relay; after a failed attempt, back to
        choose_replica until one commits or attempts run out, then the last failure is
        answered. A replica or fallback not tried yet is tried at once: a Retry-After or a
        backoff is waited for only to go back to one already tried."""
        prefer: Replica | None = None
        broken: StreamBroken | None = None  # the committed stream being continued
        won: Handover | None = None  # a first-token race's hedge that won: the next attempt
        while True:
            failure: AttemptFailed | None = None
            try:
                return await self.attempt(ex, request, watchdog, overrides, prefer,
                                          continuing=broken is not None, handover=won)
            except AttemptFailed as e:
                failure = e.as_record()
            except StreamBroken as e:
                broken = e.as_record()
            race, ex.race, won = ex.race, None, None
            if race is not None and failure is not None:
                # Failed before commit (or lost the race): a hedge still running is the next
                # attempt, not a failover.
                if failure.result in (TOTAL, SHUTDOWN):
                    race.close()
                elif (won := await race.hedge_after_primary()) is not None:
                    lost_tokens = ex.token_events
                    ex.attempt_failed(failure.result, self.tracing.end_attempt(ex, failure.result))
                    self._race_over(ex, race, WON, lost_tokens)
                    continue
            if broken is not None:  # committed: continue the answer, or end it with its error
                result = failure.result if failure is not None else broken.result
                if result in (TOTAL, SHUTDOWN) or not self._may_continue(ex):
                    return await self._end_broken(ex, broken)
                ex.continuing(result, self.tracing.end_attempt(ex, result))
                if result == PREEMPTED:  # its slot went to another request: wait for one
                    try:
                        prefer = await self._resume(ex, watchdog)
                    except asyncio.CancelledError:
                        if watchdog.claim() is None:
                            raise  # the client went away
                        return await self._end_broken(ex, broken)
                    except GatewayError:  # nothing left that could continue it
                        return await self._end_broken(ex, broken)
                continue
            assert failure is not None
            delay, prefer = self._next_try(ex, failure)
            if delay is None:
                return self.answer_failure(ex, failure)
            ex.attempt_failed(failure.result, self.tracing.end_attempt(ex, failure.result))
            if delay > 0:
                await asyncio.sleep(delay)

    def _next_try(self, ex: Exchange, failure: AttemptFailed) -> tuple[float | None,
                                                                       Replica | None]:
        """When the next attempt starts (None: there is none) and the replica it should go
        back to, if any. Within max_attempts and the retry budget: at once to a replica or
        fallback not tried yet; else, after the upstream's Retry-After (up to
        retry_after_cap_s) or the jittered backoff, to one already tried. With
        `same_replica_first`, a transient 5xx goes back to its replica once, after the
        backoff."""
        retry = self.retry
        attempts = len(ex.attempts) + 1
        if not failure.retryable or attempts >= retry.max_attempts:
            return None, None
        if failure.result == ATTEMPT_CONTEXT_LENGTH:  # only a larger model may serve it
            ex.too_long_for = (*ex.too_long_for, ex.served_model or ex.model or "")
            return (0.0 if self._untried(ex) else None), None
        assert ex.attempt is not None
        replica = ex.attempt.replica
        delay = 0.0
        prefer = None
        if (retry.same_replica_first and failure.status >= 500 and failure.judges_backend
                and not any(a.replica is replica for a in ex.attempts)):
            delay, prefer = self._backoff_s(attempts), replica
        elif not self._untried(ex):
            after = failure.retry_after_s
            if after is not None and after > retry.retry_after_cap_s:
                return None, None  # longer than we may wait, and nowhere else to go
            delay = self._backoff_s(attempts) if after is None else after
        if now_ns() + int(delay * 1e9) >= ex.retry_budget_at:
            return None, None
        return delay, prefer

    def _may_continue(self, ex: Exchange) -> bool:
        """May a broken stream be continued (once more)? Within max_continuations, by a
        backend that can continue a prefill, for the model served or its fallbacks, and for a
        request whose answer can be continued (one choice, text only so far)."""
        # a continuation admission asked for (preemption) is not a failure's: not counted
        if not self.prefill_models or (len(ex.continued_from) - ex.preempted
                                       >= self.retry.max_continuations):
            return False
        api = self._api(ex)
        if not (api.continues and ex.stream and api.choices(ex.parsed) == 1):
            return False
        if "*" in self.prefill_models:
            return True
        served = ex.served_model or ex.model or ""
        return any(m in self.prefill_models
                   for m in (served, *self.cfg.fallbacks.get(ex.model or "", ())))

    async def _resume(self, ex: Exchange, watchdog: Watchdog) -> Replica:
        """A preempted stream waits for admission to give it a slot again (the next to free,
        before any queued request), within the first-token deadline of its continuation.
        Returns the replica the continuation goes to."""
        assert self.admission is not None and ex.attempts
        timeouts = ex.attempts[-1].timeouts
        watchdog.attempt(timeouts.first_token_s, timeouts.idle_s, continuing=True)
        ticket = await self.admission.resume(ex, self._api(ex).family)
        ticket.preemptible = PreemptibleStream(ex, watchdog, self._may_continue)
        ex.ticket = ticket
        ex.on_first_token = ticket.first_token
        return ticket.replica

    async def _end_broken(self, ex: Exchange, broken: StreamBroken) -> web.StreamResponse:
        """No continuation: the stream ends with the error event it would have had (the
        upstream's own, when it ended it with one)."""
        if broken.said:
            return await end_as_said(ex, broken.said)
        return await end_with_error(ex, self._api(ex), broken.reason, broken.outcome,
                                    broken.message, broken.code)

    def _backoff_s(self, attempts: int) -> float:
        """Jittered exponential: random in [0, base × 2^(n-1)], capped (full jitter)."""
        return random.uniform(0.0, min(self.retry.backoff_max_s,
                                       self.retry.backoff_base_s * 2 ** (attempts - 1)))

    def _untried(self, ex: Exchange) -> list[Replica]:
        """The replicas not tried yet, of the model or a fallback, that would take this
        request now."""
        api = self._api(ex)
        tried = [a.replica for a in ex.attempts]
        if ex.attempt is not None:
            tried.append(ex.attempt.replica)
        return [r for m in self._model_chain(ex) for r in self.router.replicas_for(m, api.family)
                if r not in tried and r.available(ex.tenant_label) and self._may_send(ex, m, r)]

    async def attempt(self, ex: Exchange, request: web.Request, watchdog: Watchdog,
                      overrides: DeadlineOverrides, prefer: Replica | None = None,
                      continuing: bool = False,
                      handover: Handover | None = None) -> web.StreamResponse:
        """One upstream attempt: choose a replica, send, relay (or go on with the hedge that
        won a first-token race: `handover`). Its failure before commit is counted against the
        replica (when it says something about the replica's health) and raised as
        AttemptFailed; so is a committed answer that did not complete (cut, stalled, an error
        in band)."""
        if handover is None:
            attempt = self.choose_replica(ex, overrides, prefer, continuing)
        else:
            attempt = self._adopt(ex, handover, watchdog)
        replica = attempt.replica
        try:
            try:
                if handover is not None:
                    up = handover.up
                else:
                    if self.hedging is not None and not continuing:
                        self._arm_race(ex, request, watchdog, overrides)
                    up = await self.send_upstream(ex, request, attempt, watchdog, continuing)
                response = await self.relay(ex, request, up, watchdog, continuing, handover)
            except asyncio.CancelledError:
                # A deadline (or the drain) that fires before anything was committed — while
                # connecting, waiting for headers, reading an error or a whole body — makes
                # it a failed attempt; the relay handles the ones that fire after commit.
                reason = watchdog.claim()
                if reason is None or (ex.t_committed and not continuing):
                    raise  # the client went away (or it is too late for an HTTP error)
                raise deadline_failure(reason) from None
        except AttemptFailed as e:
            ex.last_failure = e.as_record()
            self._count(replica, e.result, continuing)
            self._judge(attempt, e.judges_backend and not self._clients_own(
                e.result, attempt, overrides), e.cause)
            attempt.close()
            raise
        except StreamBroken as e:  # committed, then cut or stalled: the proxy may continue it
            self._count(replica, e.result, continuing)
            self._judge(attempt, e.result != PREEMPTED
                        and not self._clients_own(e.result, attempt, overrides),
                        f"{e.result} after the first token ({e.reason})")
            attempt.close()
            raise
        except BaseException:
            # The client left (or a bug of ours): that says nothing about the replica, but a
            # half-open probe this attempt held must go to the next request.
            if attempt.probe:
                replica.breaker.release(attempt.tenant)
            raise
        result = committed_result(ex)
        self._count(replica, result, continuing)
        if result == ATTEMPT_OK:
            replica.breaker.success(attempt.tenant)
        else:
            backends_fault = ex.status >= 500 or (
                result in BACKEND_FAULTS and not failures.request_error_type(ex.error_type))
            self._judge(attempt, backends_fault
                        and not self._clients_own(result, attempt, overrides),
                        f"status {ex.status}" if ex.status >= 400
                        else f"{result} after the first token ({ex.error_type})")
        return response

    # -- the first-token race -------------------------------------------------------------------

    def _arm_race(self, ex: Exchange, request: web.Request, watchdog: Watchdog,
                  overrides: DeadlineOverrides) -> None:
        """A stream of a class that races gets a hedge if its first token is not there after
        the class's delay (one race per request)."""
        assert self.hedging is not None
        if not ex.stream or ex.hedge is not None or ex.race is not None:
            return
        delay = self.hedging.delay_s(ex)
        if delay is None:
            return
        race = ex.race = Race(watchdog, ex.target.name)
        race.timer = asyncio.get_running_loop().call_later(
            delay, self._start_hedge, ex, request, overrides, race)

    def _start_hedge(self, ex: Exchange, request: web.Request, overrides: DeadlineOverrides,
                     race: Race) -> None:
        """The first token is late: start the hedge, if a replica not tried has room, the
        admission queue is empty and the tenant's budget allows."""
        race.timer = None
        if race.winner is not None or not race.primary_running or ex.t_first_token:
            return
        assert self.hedging is not None
        spare = self._untried(ex)
        if not spare:
            self.hedging.skipped(ex, SKIP_NO_REPLICA)
            return
        if self.admission is not None and not self.admission.room_for_hedge(spare):
            self.hedging.skipped(ex, SKIP_SATURATED)
            return
        if self.hedging.spend(ex):
            race.task = asyncio.create_task(self._hedge(ex, request, overrides, race))

    async def _hedge(self, ex: Exchange, request: web.Request, overrides: DeadlineOverrides,
                     race: Race) -> Handover | None:
        """The hedge: on its own fork of the exchange, choose a replica not tried, send, and
        read until its first token. Hands on what the relay needs if it won; None if it lost
        or failed (counted and judged like any attempt, recorded on the request's
        attempts)."""
        hedging = self.hedging
        assert hedging is not None
        fork = ex.fork()
        watchdog = Watchdog(fork, race.watchdog.total_at, 0.0)  # this task's own deadlines
        try:
            try:
                attempt = self.choose_replica(fork, overrides)
                up = await self.send_upstream(fork, request, attempt, watchdog)
                if (up.status != 200
                        or not up.headers.get("Content-Type", "").startswith("text/event-stream")):
                    raise AttemptFailed(f"http_{up.status}", 502, f"The hedge was answered "
                                        f"{up.status}.", "upstream_error",
                                        judges_backend=up.status >= 500)
                probe = FirstTokenProbe(fork, up, self._api(fork), race,
                                        self.cfg.server.max_event_bytes)
                won = await probe.run()
            except asyncio.CancelledError:
                reason = watchdog.claim()
                if reason is None:
                    raise  # the race is over, or the request
                raise deadline_failure(reason) from None
        except AttemptFailed as e:  # (sent: choose_replica raises no AttemptFailed for a fork)
            judged = e.judges_backend and not self._clients_own(e.result, attempt, overrides)
            self._hedge_over(ex, fork, race, e.result, FAILED, judged, e.cause)
            return None
        except GatewayError:  # nothing left to send it to
            hedging.skipped(ex, SKIP_NO_REPLICA)
            return None
        except asyncio.CancelledError:
            self._hedge_over(ex, fork, race, ATTEMPT_HEDGE_LOST,
                             LOST if race.winner == PRIMARY else ABANDONED)
            raise
        finally:
            watchdog.stop()
        if not won:
            self._hedge_over(ex, fork, race, ATTEMPT_HEDGE_LOST, LOST)
            return None
        return Handover(fork, attempt, up, probe.replay)

    def _hedge_over(self, ex: Exchange, fork: Exchange, race: Race, result: str, outcome: str,
                    judged: bool = False, cause: str = "") -> None:
        """A hedge that did not win: its connection closed now (the engine aborts it), its
        attempt counted, judged when it says something about the backend, and recorded."""
        attempt = fork.attempt
        if attempt is not None:
            self._count(attempt.replica, result, False)
            self._judge(attempt, judged, cause)
            attempt.close()
            fork.attempt_failed(result, self.tracing.end_attempt(fork, result))
            ex.attempts.append(fork.attempts[-1])
        self._race_over(ex, race, outcome, fork.token_events)

    def _race_over(self, ex: Exchange, race: Race, outcome: str, loser_tokens: int) -> None:
        ex.hedge = outcome
        assert self.hedging is not None
        self.hedging.ended(race.cls, outcome, loser_tokens)

    def _adopt(self, ex: Exchange, won: Handover, watchdog: Watchdog) -> Attempt:
        """The hedge won: its attempt becomes the request's, watched by the request's own
        deadlines from now on."""
        ex.adopt(won.fork)
        attempt = won.attempt
        if ex.ticket is not None:
            ex.ticket.move(attempt.replica)
        watchdog.attempt(attempt.timeouts.first_token_s, attempt.timeouts.idle_s)
        return attempt

    def _count(self, replica: Replica, result: str, continuing: bool) -> None:
        """upstream_attempts_total, and continuations_total for a continuation's attempt."""
        self.metrics.child(self.metrics.attempts, (replica.name, result)).inc()
        if continuing:
            self.metrics.child(self.metrics.continuations, (replica.name, result)).inc()

    @staticmethod
    def _judge(attempt: Attempt, failed: bool, cause: str) -> None:
        """A failure that says something about the replica goes to its breaker, with the
        tenant it happened to (one tenant's failures alone are that tenant's); anything else
        (a rate limit, the request's own 4xx, a deadline the client tightened) leaves it as it
        was, but a probe this attempt held goes to the next request."""
        if failed:
            attempt.replica.breaker.failure(cause, attempt.tenant)
        elif attempt.probe:
            attempt.replica.breaker.release(attempt.tenant)

    def _model_chain(self, ex: Exchange) -> list[str]:
        """The requested model, then its fallbacks that the key may use, in order. Once a
        model said the request is too long for its context, only its larger-context
        fallbacks ([fallbacks.context_length]) remain."""
        model = ex.model or ""
        if not ex.too_long_for:
            return [model] + [m for m in self.cfg.fallbacks.get(model, ())
                              if self.auth.allows(ex.key, m)]
        bigger = dict.fromkeys(m for small in ex.too_long_for
                               for m in self.cfg.context_fallbacks.get(small, ()))
        return [m for m in bigger if m not in ex.too_long_for and self.auth.allows(ex.key, m)]

    def _may_send(self, ex: Exchange, served: str, replica: Replica) -> bool:
        """May this key's request for `served` go to `replica`? The model must be on the key's
        allow-list, and so must the name the replica's alias sends upstream when that name is
        itself a model the gateway serves (an alias must not be a way round the list)."""
        if not self.auth.allows(ex.key, served):
            return False
        upstream = replica.cfg.aliases.get(served, served)
        return (upstream == served or self.auth.allows(ex.key, upstream)
                or self.router.model_label(upstream) == "other")

    @staticmethod
    def _clients_own(result: str, attempt: Attempt, overrides: DeadlineOverrides) -> bool:
        """A deadline (or connect timeout) the client itself tightened ran out: that is the
        client's choice and says nothing about the backend's health."""
        if result not in (FIRST_TOKEN, IDLE, TOTAL, CONNECT_ERROR, ATTEMPT_STALLED):
            return False
        return overrides.tightened(attempt.replica.cfg.timeouts, attempt.timeouts)

    def choose_replica(self, ex: Exchange, overrides: DeadlineOverrides,
                       prefer: Replica | None = None, continuing: bool = False) -> Attempt:
        """The replica admission chose (for the model it found capacity for: the requested
        one or a fallback), if its breaker lets this request through (a half-open breaker
        admits one probe, however the replica was chosen); else an untried replica of the
        model, then of its fallback models the key may use, in order; else one already tried
        (a retry after Retry-After may go back). Every attempt's model is checked against the
        key's allow-list. `prefer`: a replica to go back to first (same_replica_first). A
        continuation goes only to a backend that can continue a prefill, for the model served
        (or its fallbacks). Hands on `ex.attempt`."""
        api = self._api(ex)
        tried = [a.replica for a in ex.attempts]
        ticket = ex.ticket
        chosen: tuple[Replica, str] | None = None
        served = ex.model or ""
        if continuing:
            ticket = None  # admission's replica may not continue; the chain below decides
        if (prefer is not None and prefer.healthy and ex.served_model is not None
                and self._may_send(ex, ex.served_model, prefer)
                and prefer.breaker.acquire(ex.tenant_label)):
            served = ex.served_model
            chosen = prefer, prefer.cfg.aliases.get(served, served)
        elif (ticket is not None and ticket.replica not in tried and ticket.replica.healthy
                and self._may_send(ex, ticket.model, ticket.replica)
                and ticket.replica.breaker.acquire(ex.tenant_label)):
            served = ticket.model
            chosen = ticket.replica, ticket.replica.cfg.aliases.get(served, served)
        else:
            chain = [m for m in self._model_chain(ex) if self.auth.allows(ex.key, m)]
            if continuing and ex.served_model in chain:  # the same model first, if it can
                chain.remove(ex.served_model)
                chain.insert(0, ex.served_model)
            last: GatewayError | None = None
            for exclude in (tried, ()):
                for name in chain:
                    forbidden = [r for r in self.router.replicas_for(name, api.family)
                                 if not self._may_send(ex, name, r)
                                 or (continuing and r.cfg.continuation != "prefill")]
                    try:
                        chosen = self.router.pick(name, api.family, [*exclude, *forbidden],
                                                  ex.tenant_label)
                        served = name
                        break
                    except GatewayError as e:
                        last = e.with_traceback(None)
                if chosen is not None:
                    break
            if chosen is None:
                if ex.last_failure is not None:
                    # Nowhere left to go: the client hears about the last real failure.
                    ex.last_failure.retryable = False
                    raise ex.last_failure
                if last is None:
                    self.auth.authorize(ex.key, ex.model or "")
                    raise AssertionError("unreachable: the requested model is allowed")
                try:
                    raise last
                finally:
                    del last  # held by this frame, it would make a cycle with its traceback
        replica, upstream_model = chosen
        ex.served_model = served
        if continuing and ex.on_first_token is not None and ex.ticket is not None:
            ticket = ex.ticket  # a preempted stream's new slot (admission's): its claim goes
            # where the continuation does (one awaiting its first token moves with it)
        if ticket is not None:
            ticket.move(replica)
        attempt = Attempt(replica, upstream_model, overrides.apply(replica.cfg.timeouts),
                          replica.provider, probe=replica.breaker.probing_for(ex.tenant_label),
                          tenant=ex.tenant_label)
        ex.attempt = attempt
        ex.backend = replica.name
        ex.server_address, ex.server_port = replica.address, replica.port
        ex.upstream_model = upstream_model
        return attempt

    async def send_upstream(self, ex: Exchange, request: web.Request, attempt: Attempt,
                            watchdog: Watchdog, continuing: bool = False) -> UpstreamResponse:
        """Prepare the body and headers for this replica (the API adapter decides the body;
        the provider the auth and default headers), send, and wait for the response headers.
        A connect failure or a retryable status is an AttemptFailed. Hands on the upstream
        response (also `attempt.response`)."""
        api = self._api(ex)
        replica, timeouts = attempt.replica, attempt.timeouts
        provider = attempt.provider
        send = dict(ex.parsed)
        continued = None
        if continuing:  # the same request, with the answer so far to continue
            continued = api.continuation_body(send, ex.route, "".join(ex.streamed_text or ()),
                                              ex.token_events)
            if continued is None:
                raise AttemptFailed(ATTEMPT_CUT, 502, "The answer cannot be continued.",
                                    "stream_truncated", retryable=False, judges_backend=False)
            send = continued
        prepared = api.prepare(send, ex.route, ex.stream, replica.cfg, provider)
        ex.usage_injected = prepared.usage_injected
        changed = prepared.changed or continued is not None
        if attempt.upstream_model != send.get("model"):
            send["model"] = attempt.upstream_model
            changed = True
        data = orjson.dumps(send) if changed else ex.body
        headers = upstream_request_headers(request.headers,
                                           forward_auth=replica.cfg.forward_client_auth,
                                           forward=replica.cfg.forward_headers,
                                           deny=replica.cfg.deny_headers)
        headers["Content-Type"] = "application/json"
        headers["X-Request-Id"] = ex.request_id
        for name, value in provider.default_headers.items():
            if name not in headers:  # e.g. anthropic-version, unless the client chose one
                headers[name] = value
        if replica.api_key:
            headers.update(provider.auth_headers(replica.api_key))
        if "Accept" not in headers:
            headers["Accept"] = "*/*"  # what aiohttp's client sent by default
        target = replica.target(ROUTES[ex.route][1])
        if not continuing:  # a continuation leaves the timeline of the answer it goes on with
            ex.t_sent = now_ns()
            ex.t_dispatched = ex.t_dispatched or ex.t_sent
        watchdog.attempt(timeouts.first_token_s if ex.stream else timeouts.total_s,
                         timeouts.idle_s, continuing)
        self.tracing.upstream_attempt(ex, headers, replica.cfg.propagate_trace)
        timeout = replica.timeout
        if timeouts.connect_s < replica.cfg.timeouts.connect_s:  # a request that asked for less
            timeout = aiohttp.ClientTimeout(total=None, connect=None,
                                            sock_connect=timeouts.connect_s)
        # a new connection is stamped on the exchange (not a continuation's: see above)
        connecting = CONNECTING.set(None if continuing else ex)
        try:
            up = await upstream.send(replica.connector, target, headers, data, timeout)
        except UpstreamUnreachable as e:
            raise AttemptFailed(CONNECT_ERROR, 502, f"Backend '{replica.name}' is unreachable: "
                                f"{e}.", "upstream_unreachable", cause=str(e)) from None
        except UpstreamInvalid as e:  # another replica may answer in HTTP
            code = limits.HEADERS_TOO_LARGE if e.too_large else INVALID_RESPONSE
            raise AttemptFailed(code, 502, f"Backend '{replica.name}' sent an answer the "
                                f"gateway cannot read: {e}.", code, cause=str(e)) from None
        finally:
            CONNECTING.reset(connecting)
        attempt.response = up
        if not continuing:
            ex.t_headers = now_ns()
            ex.status = up.status
        if 300 <= up.status < 400:  # never followed: our upstream key would go along
            raise AttemptFailed(limits.UPSTREAM_REDIRECT, 502, f"Backend '{replica.name}' "
                                f"answered {up.status} (a redirect); the gateway does not "
                                "follow redirects.", limits.UPSTREAM_REDIRECT)
        if up.status == 101:  # the connection now speaks another protocol: closed, not pooled
            raise AttemptFailed(limits.UPSTREAM_UPGRADE, 502, f"Backend '{replica.name}' "
                                "answered 101 Switching Protocols; the gateway relays HTTP "
                                "answers only.", limits.UPSTREAM_UPGRADE)
        if up.status in self.retry.statuses:
            raise await self._retryable_status(ex, up)
        return up

    async def relay(self, ex: Exchange, request: web.Request, up: UpstreamResponse,
                    watchdog: Watchdog, continuing: bool = False,
                    handover: Handover | None = None) -> web.StreamResponse:
        """The upstream response to the client: an event stream byte-exact as it arrives
        (committed at the first token, or at the headers), anything else read whole (bounded)
        and passed through with its status."""
        extra = ((REQUEST_ID_HEADER, ex.request_id),)
        api = self._api(ex)
        ctype = up.headers.get("Content-Type", "")
        if continuing:
            if up.status != 200 or not ctype.startswith("text/event-stream"):
                body = await upstream.read_head(up, MAX_ERROR_BODY)
                raise AttemptFailed(f"http_{up.status}" if up.status != 200 else ATTEMPT_CUT,
                                    502, f"The continuation was refused ({up.status}): "
                                    f"{body[:200].decode('utf-8', 'replace')}",
                                    "stream_truncated", judges_backend=up.status >= 500)
            return await Relay(request, ex, up, api, None, hold_until_first_token=False,
                               watchdog=watchdog, keepalive_s=self.cfg.server.keepalive_s,
                               max_event_bytes=self.cfg.server.max_event_bytes,
                               splice=Splice(ex.response_id, ex.response_model,
                                             ex.continued_from[-1], api.continuation_repeat(
                                                 "".join(ex.streamed_text or ())))).run()
        if up.status != 200 or not ex.stream or not ctype.startswith("text/event-stream"):
            return await self._whole(ex, up, api, extra)
        if self._may_continue(ex):
            ex.streamed_text = []
        headers_out = client_response_headers(up.headers, event_stream=True, extra=extra)
        capture: list[str] | None = [] if self._capturing(ex) else None
        ex.captured_output = capture
        return await Relay(request, ex, up, api, headers_out,
                           hold_until_first_token=self.hold_until_first_token,
                           watchdog=watchdog, keepalive_s=self.cfg.server.keepalive_s,
                           capture=capture,
                           max_event_bytes=self.cfg.server.max_event_bytes,
                           race=ex.race if handover is None else None,
                           replay=None if handover is None else handover.replay).run()

    def finish(self, ex: Exchange) -> None:
        """Release what the request held (admission ticket, upstream connection: back to the
        pool only after a clean end), then verdict, metrics, spans and the access log, once,
        from the finished timeline."""
        if ex.ticket is not None:
            ex.ticket.finish(ex)
        if ex.race is not None:  # a hedge still running ends with its request
            ex.race.close()
            ex.race = None
        if self.hedging is not None:
            self.hedging.finished(ex)
        if ex.attempt is not None and ex.attempt.response is not None:
            if ex.outcome == OK:  # pooled (closed instead if its body did not end: lingered)
                ex.attempt.response.release()
                ex.attempt.response = None
            else:
                ex.attempt.close()
        self.metrics.in_flight.dec()
        if ex.admission is ADMISSION_OFF:
            self.metrics.child(self.metrics.admission, (ex.model_label, ex.route, ex.target.name,
                                                        *ADMISSION_OFF)).inc()
        last = ex.attempt or (ex.attempts[-1] if ex.attempts else None)
        self.finisher.finish(ex, ex.operation,
                             last.replica.cfg.provider if last is not None else "unknown")

    # -- answers ---------------------------------------------------------------------------------

    def answer_failure(self, ex: Exchange, e: AttemptFailed) -> web.Response:
        """Retries are over: the last upstream error response passes through as it was;
        otherwise the gateway's own error in the client's format."""
        ex.status = e.status
        if e.response is not None:
            ex.finish(UPSTREAM_ERROR, str(e.status) if e.status >= 400 else e.code)
            status, headers, body = e.response
            return web.Response(status=status, body=body, headers=headers)
        error = e.as_gateway_error()
        ex.finish(error.outcome, e.code)
        return self.error_response(ex, error)

    def error_response(self, ex: Exchange, e: GatewayError) -> web.Response:
        headers = {REQUEST_ID_HEADER: ex.request_id, **e.headers}
        if isinstance(e, RateLimited):  # what the client's SDK reads to pace its retries
            headers.update(self._api(ex).rate_limit_headers(e.limits))
        return web.Response(status=e.status, body=self._api(ex).error_body(
            e.status, e.message, e.code, e.param), content_type="application/json",
            headers=headers)

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _api(ex: Exchange) -> Api:
        assert ex.api is not None
        return ex.api

    def _capturing(self, ex: Exchange) -> bool:
        """Content capture: only when the operator opted in, and only for a recorded span."""
        return (self.tracing.capture_content and ex.trace is not None
                and ex.trace.sampled)

    async def _retryable_status(self, ex: Exchange,
                                up: UpstreamResponse) -> AttemptFailed:
        """A 429/5xx before anything was committed: worth another attempt, unless the upstream
        asks for a longer wait than we may spend. A rate limit says nothing about health."""
        body = await upstream.read_head(up, MAX_ERROR_BODY)
        headers = dict(client_response_headers(up.headers, event_stream=False,
                                               extra=((REQUEST_ID_HEADER, ex.request_id),)))
        return AttemptFailed(f"http_{up.status}", up.status, f"Upstream answered {up.status}.",
                             f"upstream_{up.status}", retry_after_s=retry_after_s(up.headers),
                             response=(up.status, headers, body),
                             judges_backend=up.status != 429)

    async def _whole(self, ex: Exchange, up: UpstreamResponse, api: Api,
                     extra: tuple[tuple[str, str], ...]) -> web.StreamResponse:
        """A response that is not an event stream (non-stream answer or an upstream error):
        read it whole and pass status, headers and body through."""
        if up.status >= 400:
            body = await upstream.read_head(up, MAX_ERROR_BODY)
            if up.status < 500 and failures.http_error(body) == failures.CONTEXT_LENGTH:
                # A larger model may serve it ([fallbacks.context_length]); if none may, the
                # answer passes through as it came.
                headers = client_response_headers(up.headers, event_stream=False, extra=extra)
                raise AttemptFailed(ATTEMPT_CONTEXT_LENGTH, up.status, f"Upstream answered "
                                    f"{up.status}: too long for the context of "
                                    f"'{ex.served_model}'.", ATTEMPT_CONTEXT_LENGTH,
                                    response=(up.status, headers, body), judges_backend=False)
        else:
            try:
                body = await upstream.read_capped(up, self.cfg.server.max_response_bytes)
            except ResponseTooLarge as e:
                raise AttemptFailed(limits.RESPONSE_TOO_LARGE, 502, str(e),
                                    limits.RESPONSE_TOO_LARGE, retryable=False) from None
            except UpstreamLost:  # nothing reached the client yet: another replica may answer
                raise AttemptFailed(ATTEMPT_CUT, 502, f"Backend '{ex.backend}' closed the "
                                    "connection before the end of its answer.",
                                    "upstream_response_truncated") from None
            if up.status != 200 or not body:
                # Every route proxied is a generation: a 201/202/204 or an empty 200 is no
                # answer an SDK can read (it would pass as ok); another replica may answer.
                raise AttemptFailed(NO_ANSWER, 502, f"Backend '{ex.backend}' answered "
                                    f"{up.status} without an answer"
                                    f"{' (an empty body)' if up.status == 200 else ''}.",
                                    "upstream_no_answer")
            if ex.stream:
                # An SDK that asked for a stream reads no event out of a whole answer: its
                # stream would end empty and the request count as ok.
                raise AttemptFailed(NOT_STREAMED, 502, f"Backend '{ex.backend}' answered a "
                                    "streamed request with a whole response, not an event "
                                    "stream.", "upstream_not_streamed")
        # No token stamps: a whole answer has no first token (it is measured by e2e), and an
        # error answer never has one.
        if up.status < 400:
            ex.read_facts(api.observe_response(body))
            if self._capturing(ex):
                ex.captured_output = [body[:CAPTURE_LIMIT].decode("utf-8", "replace")]
            ex.finish(OK)
        else:
            ex.finish(UPSTREAM_ERROR, str(up.status))
        headers = client_response_headers(up.headers, event_stream=False, extra=extra)
        return web.Response(status=up.status, body=body, headers=headers)


def retry_after_s(headers: Any) -> float | None:
    """Retry-After (seconds or an HTTP date) or retry-after-ms, in seconds."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1e3)
        except ValueError:
            pass
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def committed_result(ex: Exchange) -> str:
    """What an attempt that answered the client came to (upstream_attempts_total{result}): a
    complete answer, an upstream error passed through, or how its stream ended early."""
    if ex.status >= 400:
        return f"http_{ex.status}"
    if ex.outcome == OK:
        return ATTEMPT_OK
    reason = ex.interruption or ex.error_type
    if reason == IDLE:
        return ATTEMPT_STALLED
    if reason in (TOTAL, SHUTDOWN, limits.EVENT_TOO_LARGE):
        return reason
    if ex.outcome == UPSTREAM_TRUNCATED:
        return ATTEMPT_CUT
    if ex.outcome == UPSTREAM_ERROR:
        return ATTEMPT_IN_BAND_ERROR
    return ex.outcome or ATTEMPT_OK
