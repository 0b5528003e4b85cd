"""The proxy handler: runs a request through the phases
ingress → routing → upstream → relay → finish, with one RequestContext.

A failure before commit (connect error, retryable status, first-token deadline, upstream closed
before the first token) is not a second code path: the attempt is recorded on the timeline and
routing picks the next replica (or fallback model), with tenacity's jittered backoff or the
upstream's Retry-After, within the attempt limit and the retry budget.
"""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from tenacity import (AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt,
                      wait_random_exponential)

import backends
from gateway import deadlines, ingress, limits
from gateway.admission.controller import AdmissionController, prefix_key
from gateway.auth import AuthPolicy
from gateway.config import Config
from gateway.context import (CLIENT_CANCELLED, GATEWAY_ERROR, OK, TIMEOUT, UPSTREAM_ERROR,
                             RequestContext, now_ns)
from gateway.deadlines import Watchdog
from gateway.errors import GatewayError
from gateway.finish import Finisher
from gateway.headers import client_response_headers, upstream_request_headers
from gateway.relay import AttemptFailed, ClientGone, Relay, before_commit_failure
from gateway.routing import Replica, Router, current_request
from gateway.telemetry.prometheus import Metrics
from gateway.telemetry.tracing import Tracing

REQUEST_ID_HEADER = "x-slogate-request-id"
# Upstream error bodies are passed through; bounded so a misbehaving upstream cannot make us
# hold an unbounded body.
MAX_ERROR_BODY = 1024 * 1024


class Proxy:
    def __init__(self, cfg: Config, router: Router, finisher: Finisher,
                 admission: AdmissionController | None = None) -> None:
        self.cfg = cfg
        self.router = router
        self.admission = admission
        self.auth: AuthPolicy = cfg.auth
        self.slo = cfg.slo
        self.retry = cfg.retry
        self.finisher = finisher
        self.metrics: Metrics = finisher.metrics
        self.tracing: Tracing = finisher.tracing
        self.max_body_bytes = cfg.server.max_body_bytes
        self.hold_until_first_token = cfg.server.commit == "first_token"
        self.keepalive_s = cfg.server.keepalive_s
        self.active: set[Watchdog] = set()  # requests in flight (for the drain)
        self._backoff = wait_random_exponential(multiplier=cfg.retry.backoff_base_s,
                                                max=cfg.retry.backoff_max_s)

    def end_all(self, reason: str) -> None:
        """End every request in flight now (drain deadline): streams get an error event."""
        for watchdog in list(self.active):
            watchdog.fire(reason)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        route = request.path
        api = backends.api_for(route)
        operation = api.OPERATIONS[route]
        ctx = RequestContext(route)
        state: dict[str, Any] = {"provider": "unknown", "up": None}
        self.metrics.in_flight.inc()
        watchdog: Watchdog | None = None
        try:
            key = self.auth.authenticate(request.headers)
            if key is not None:
                ctx.tenant = key.tenant
            ctx.slo = self.slo.target_for(route, request.headers)
            body = await ingress.read_body(request, self.max_body_bytes,
                                           self.cfg.server.body_timeout_s)
            ctx.t_body = now_ns()
            parsed = ingress.parse_json(body)
            ctx.model = ingress.model_of(parsed)
            self.auth.authorize(key, ctx.model)
            ctx.model_label = self.router.model_label(ctx.model)
            ctx.stream = ingress.stream_of(parsed)
            first = self.router.replicas_for(ctx.model, api.FAMILY)
            timeouts = (first[0].cfg.timeouts if first else self.cfg.backends[0].timeouts)
            timeouts = timeouts.tightened(request.headers)
            state["timeouts"] = timeouts
            if self.tracing.enabled:
                self.tracing.start(ctx, request.headers, operation)
            watchdog = Watchdog(ctx, ctx.t_received + int(timeouts.total_s * 1e9),
                                timeouts.idle_s)
            self.active.add(watchdog)
            if self.admission is None:
                ctx.admission = ("admitted", "admission_off")
                self.metrics.child(self.metrics.admission, (ctx.model_label, route, ctx.slo.name,
                                                            *ctx.admission)).inc()
            else:
                ticket = await self.admission.admit(
                    ctx, api.FAMILY, len(body),
                    prefix_key(parsed, self.cfg.admission.prefix_bytes))
                state["ticket"] = ticket
                ctx.on_first_token = ticket.first_token
            return await self._with_retries(request, ctx, api, parsed, body, watchdog,
                                            request.headers, state)
        except GatewayError as e:
            ctx.finish(e.outcome, e.code)
            ctx.status = e.status
            return self._error(ctx, api, e)
        except (asyncio.CancelledError, ClientGone):
            reason = watchdog.claim() if watchdog is not None else None
            if reason is not None and not ctx.t_committed:  # e.g. while queued for admission
                e = before_commit_failure(reason)
                ctx.finish(TIMEOUT, e.code)
                ctx.status = e.status
                return self._error(ctx, api, GatewayError(e.status, e.message, e.code))
            ctx.cancel_phase = ctx.phase()
            ctx.finish(CLIENT_CANCELLED)
            up = state["up"]
            if up is not None:
                up.close()  # close, not release: the engine must see the disconnect now
                state["up"] = None
            raise
        except Exception as e:  # a bug of ours: answer cleanly, keep serving
            ctx.finish(GATEWAY_ERROR, type(e).__name__)
            request.app.logger.exception("internal error on %s", route)
            if ctx.t_committed:
                raise  # the response has begun; aiohttp closes the connection
            return self._error(ctx, api, GatewayError(500, "Internal gateway error.",
                                                      "gateway_error", outcome=GATEWAY_ERROR))
        finally:
            if watchdog is not None:
                watchdog.stop()
                self.active.discard(watchdog)
            ticket = state.get("ticket")
            if ticket is not None:
                ticket.finish(ctx)
            up = state["up"]
            if up is not None:
                if ctx.outcome == OK:
                    up.release()
                else:
                    up.close()
            self.metrics.in_flight.dec()
            self.finisher.finish(ctx, operation, state["provider"])

    # -- attempts ----------------------------------------------------------------------------

    def _wait(self, rs: RetryCallState) -> float:
        exc = rs.outcome.exception() if rs.outcome else None
        if isinstance(exc, AttemptFailed) and exc.retry_after_s is not None:
            return exc.retry_after_s
        return self._backoff(rs)

    def _stop(self, ctx: RequestContext, first_token_s: float):
        # Default budget: twice the first-token deadline of the request's own backend, so that
        # one stalled attempt still leaves room for another.
        budget_s = self.retry.budget_s or 2 * first_token_s
        budget_at = ctx.t_received + int(budget_s * 1e9)
        by_count = stop_after_attempt(self.retry.max_attempts)

        def stop(rs: RetryCallState) -> bool:
            return by_count(rs) or now_ns() + int((rs.upcoming_sleep or 0) * 1e9) >= budget_at

        return stop

    async def _with_retries(self, request, ctx, api, parsed, body, watchdog, headers_in,
                            state) -> web.StreamResponse:
        tried: list[Replica] = []
        try:  # the common case: one attempt, nothing spent on retry machinery
            return await self._attempt(request, ctx, api, parsed, body, watchdog, headers_in,
                                       state, tried)
        except AttemptFailed as e:
            if not e.retryable or self.retry.max_attempts == 1:
                return self._final_failure(ctx, api, e)
            first_failure: AttemptFailed | None = e
        retrying = AsyncRetrying(
            stop=self._stop(ctx, state["timeouts"].first_token_s), wait=self._wait, reraise=True,
            retry=retry_if_exception(lambda e: isinstance(e, AttemptFailed) and e.retryable))
        try:
            async for attempt in retrying:
                with attempt:
                    if first_failure is not None:  # attempt 1, already made: tenacity waits
                        failure, first_failure = first_failure, None
                        raise failure
                    ctx.new_attempt(state["failed"], self.tracing.end_attempt(ctx, state["failed"]))
                    return await self._attempt(request, ctx, api, parsed, body, watchdog,
                                               headers_in, state, tried)
        except AttemptFailed as e:
            return self._final_failure(ctx, api, e)
        raise AssertionError("unreachable")  # pragma: no cover

    def _pick(self, ctx: RequestContext, family: str, tried: list[Replica],
              state: dict[str, Any]) -> tuple[Replica, str]:
        """The replica admission chose; else an untried replica of the model, then of its
        fallback models in order; else one already tried (a retry after Retry-After may go
        back)."""
        ticket = state.get("ticket")
        if ticket is not None and ticket.replica not in tried and ticket.replica.available():
            return ticket.replica, ticket.replica.cfg.aliases.get(ctx.model, ctx.model)
        chain = (ctx.model,) + tuple(self.cfg.fallbacks.get(ctx.model or "", ()))
        last: GatewayError | None = None
        for exclude in (tried, ()):
            for model in chain:
                try:
                    return self.router.pick(model, family, exclude)
                except GatewayError as e:
                    last = e
        assert last is not None
        raise last

    async def _attempt(self, request, ctx, api, parsed, body, watchdog, headers_in, state,
                       tried) -> web.StreamResponse:
        try:
            replica, upstream_model = self._pick(ctx, api.FAMILY, tried, state)
        except GatewayError:
            if not tried:
                raise
            # Nowhere left to go: the client hears about the last real failure.
            last: AttemptFailed = state["last_failure"]
            last.retryable = False
            raise last from None
        tried.append(replica)
        if state.get("ticket") is not None:
            state["ticket"].move(replica)
        timeouts = state["attempt_timeouts"] = replica.cfg.timeouts.tightened(headers_in)
        ctx.backend = replica.name
        state["provider"] = replica.cfg.provider
        ctx.server_address, ctx.server_port = replica.address, replica.port
        ctx.upstream_model = upstream_model
        send = dict(parsed)
        ctx.usage_injected = False  # decided per attempt: backends differ
        changed = api.prepare_request(ctx, send, replica.cfg)
        if upstream_model != send.get("model"):
            send["model"] = upstream_model
            changed = True
        data = orjson.dumps(send) if changed else body
        headers = upstream_request_headers(headers_in, forward_auth=replica.cfg.forward_client_auth,
                                           forward=replica.cfg.forward_headers,
                                           deny=replica.cfg.deny_headers)
        headers["Content-Type"] = "application/json"
        headers["X-Request-Id"] = ctx.request_id
        btype = backends.backend_type(replica.cfg.type)
        for name, value in getattr(btype, "DEFAULT_HEADERS", {}).items():
            if name not in headers:  # e.g. anthropic-version, unless the client chose one
                headers[name] = value
        if replica.api_key:
            headers.update(btype.auth_headers(replica.api_key))
        url = replica.url(api.ROUTES[ctx.route])
        ctx.t_sent = now_ns()
        ctx.t_dispatched = ctx.t_dispatched or ctx.t_sent
        watchdog.attempt(timeouts.first_token_s if ctx.stream else timeouts.total_s,
                         timeouts.idle_s)
        self.tracing.upstream_attempt(ctx, headers, replica.cfg.propagate_trace)
        try:
            result = await self._exchange(request, ctx, api, replica, url, data, headers,
                                          watchdog, state)
        except AttemptFailed as e:
            state["failed"] = e.result
            state["last_failure"] = e
            self.metrics.child(self.metrics.attempts, (replica.name, e.result)).inc()
            if e.result not in ("http_429",):  # rate limits are not ill health
                replica.breaker.failure()
            up = state.pop("up", None)
            state["up"] = None
            if up is not None:
                up.close()
            raise
        self.metrics.child(self.metrics.attempts, (replica.name, "ok")).inc()
        replica.breaker.success()
        return result

    async def _exchange(self, request, ctx, api, replica, url, data, headers, watchdog,
                        state) -> web.StreamResponse:
        """One upstream exchange. A deadline (or the drain) that fires before anything was
        committed — while connecting, waiting for headers, reading an error or a whole body —
        makes it a failed attempt; the relay handles the ones that fire after commit."""
        try:
            return await self._exchange_once(request, ctx, api, replica, url, data, headers,
                                             watchdog, state)
        except asyncio.CancelledError:
            reason = watchdog.claim()
            if reason is None or ctx.t_committed:
                raise  # the client went away (or it is too late for an HTTP error)
            raise before_commit_failure(reason) from None

    async def _exchange_once(self, request, ctx, api, replica, url, data, headers, watchdog,
                             state) -> web.StreamResponse:
        current_request.set(ctx)
        connect_s = state["attempt_timeouts"].connect_s
        post_kw: dict[str, Any] = {}
        if connect_s < replica.cfg.timeouts.connect_s:  # a request that asked for less
            post_kw["timeout"] = aiohttp.ClientTimeout(total=None, connect=None,
                                                       sock_connect=connect_s)
        try:
            up = await replica.session.post(url, data=data, headers=headers,
                                            allow_redirects=False, **post_kw)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise AttemptFailed("connect_error", 502, f"Backend '{replica.name}' is unreachable: "
                                f"{type(e).__name__}.", "upstream_unreachable") from None
        state["up"] = up
        ctx.t_headers = now_ns()
        ctx.status = up.status
        extra = ((REQUEST_ID_HEADER, ctx.request_id),)
        if 300 <= up.status < 400:  # never followed: our upstream key would go along
            raise AttemptFailed(limits.UPSTREAM_REDIRECT, 502, f"Backend '{replica.name}' "
                                f"answered {up.status} (a redirect); the gateway does not "
                                "follow redirects.", limits.UPSTREAM_REDIRECT)
        if up.status in self.retry.statuses:
            raise await self._retryable_status(up, extra)
        ctype = up.headers.get("Content-Type", "")
        if up.status != 200 or not ctx.stream or not ctype.startswith("text/event-stream"):
            return await self._whole(ctx, up, api, extra)
        headers_out = client_response_headers(up.headers, event_stream=True, extra=extra)
        relay = Relay(request, ctx, up, api.StreamObserver(ctx), api, headers_out,
                      hold_until_first_token=self.hold_until_first_token, watchdog=watchdog,
                      keepalive_s=self.keepalive_s,
                      max_event_bytes=self.cfg.server.max_event_bytes)
        return await relay.run()

    async def _retryable_status(self, up: aiohttp.ClientResponse, extra) -> AttemptFailed:
        """A 429/5xx before anything was committed: worth another attempt, unless the upstream
        asks for a longer wait than we may spend."""
        body = await _read_bounded(up, MAX_ERROR_BODY)
        headers = dict(client_response_headers(up.headers, event_stream=False, extra=extra))
        retry_after = _retry_after_s(up.headers)
        retryable = retry_after is None or retry_after <= self.retry.retry_after_cap_s
        return AttemptFailed(f"http_{up.status}", up.status, f"Upstream answered {up.status}.",
                             f"upstream_{up.status}", retryable=retryable,
                             retry_after_s=retry_after, response=(up.status, headers, body))

    def _final_failure(self, ctx: RequestContext, api, e: AttemptFailed) -> web.Response:
        """Retries are over: the last upstream error response passes through as it was;
        otherwise the gateway's own error in the client's format."""
        ctx.status = e.status
        if e.response is not None:
            ctx.finish(UPSTREAM_ERROR, str(e.status))
            status, headers, body = e.response
            return web.Response(status=status, body=body, headers=headers)
        outcome = TIMEOUT if e.code in (deadlines.FIRST_TOKEN, deadlines.TOTAL) else UPSTREAM_ERROR
        if e.code == deadlines.SHUTDOWN:
            outcome = GATEWAY_ERROR
        ctx.finish(outcome, e.code)
        return self._error(ctx, api, GatewayError(e.status, e.message, e.code, outcome=outcome))

    async def _whole(self, ctx: RequestContext, up: aiohttp.ClientResponse, api,
                     extra) -> web.StreamResponse:
        """A response that is not an event stream (non-stream answer or an upstream error):
        read it whole and pass status, headers and body through."""
        if up.status >= 400:
            body = await _read_bounded(up, MAX_ERROR_BODY)
        else:
            try:
                body = await limits.read_capped(up, self.cfg.server.max_response_bytes)
            except limits.ResponseTooLarge as e:
                raise AttemptFailed(limits.RESPONSE_TOO_LARGE, 502, str(e),
                                    limits.RESPONSE_TOO_LARGE, retryable=False) from None
        t = now_ns()
        ctx.t_first_event = ctx.t_first_token = ctx.t_last_token = t
        if up.status < 400:
            api.observe_response(ctx, body)
            ctx.finish(OK)
        else:
            ctx.finish(UPSTREAM_ERROR, str(up.status))
        headers = client_response_headers(up.headers, event_stream=False, extra=extra)
        return web.Response(status=up.status, body=body, headers=headers)

    @staticmethod
    def _error(ctx: RequestContext, api, e: GatewayError) -> web.Response:
        headers = {REQUEST_ID_HEADER: ctx.request_id, **e.headers}
        return web.Response(status=e.status, body=api.error_body(e.status, e.message, e.code,
                                                                  e.param),
                            content_type="application/json", headers=headers)


async def _read_bounded(up: aiohttp.ClientResponse, limit: int | None) -> bytes:
    """The whole body, or its first `limit` bytes."""
    if limit is None:
        return await up.read()
    parts, size = [], 0
    async for chunk in up.content.iter_any():
        parts.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)[:limit]


def _retry_after_s(headers) -> float | None:
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
        from email.utils import parsedate_to_datetime
        import time

        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None
