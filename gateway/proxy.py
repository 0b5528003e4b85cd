"""The proxy handler: runs a request through the phases
ingress → routing → upstream → relay → finish, with one RequestContext."""
from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

import backends
from gateway import ingress
from gateway.auth import AuthPolicy
from gateway.context import (CLIENT_CANCELLED, GATEWAY_ERROR, OK, UPSTREAM_ERROR,
                             RequestContext, now_ns)
from gateway.errors import GatewayError
from gateway.finish import Finisher
from gateway.headers import client_response_headers, upstream_request_headers
from gateway.relay import ClientGone, Relay
from gateway.routing import Router
from gateway.slo import SLOPolicy
from gateway.telemetry.prometheus import Metrics
from gateway.telemetry.tracing import Tracing

REQUEST_ID_HEADER = "x-slogate-request-id"
# Upstream error bodies are passed through; bounded so a misbehaving upstream cannot make us
# hold an unbounded body.
MAX_ERROR_BODY = 1024 * 1024


class Proxy:
    def __init__(self, router: Router, finisher: Finisher, slo: SLOPolicy, auth: AuthPolicy, *,
                 max_body_bytes: int, commit: str) -> None:
        self.router = router
        self.auth = auth
        self.finisher = finisher
        self.metrics: Metrics = finisher.metrics
        self.tracing: Tracing = finisher.tracing
        self.slo = slo
        self.max_body_bytes = max_body_bytes
        self.hold_until_first_token = commit == "first_token"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        route = request.path
        api = backends.api_for(route)
        operation = api.OPERATIONS[route]
        provider = "unknown"
        ctx = RequestContext(route)
        up: aiohttp.ClientResponse | None = None
        self.metrics.in_flight.inc()
        try:
            key = self.auth.authenticate(request.headers)
            if key is not None:
                ctx.tenant = key.tenant
            ctx.slo = self.slo.target_for(route, request.headers)
            body = await ingress.read_body(request, self.max_body_bytes)
            ctx.t_body = now_ns()
            parsed = ingress.parse_json(body)
            ctx.model = ingress.model_of(parsed)
            self.auth.authorize(key, ctx.model)
            ctx.admission = ("admitted", "admission_off")
            ctx.model_label = self.router.model_label(ctx.model)
            ctx.stream = ingress.stream_of(parsed)
            if self.tracing.enabled:
                self.tracing.start(ctx, request.headers, operation)
            replica, upstream_model = self.router.pick(ctx.model, api.FAMILY)
            ctx.backend = replica.name
            provider = replica.cfg.provider
            ctx.server_address, ctx.server_port = replica.address, replica.port
            ctx.upstream_model = upstream_model
            changed = api.prepare_request(ctx, parsed)
            if upstream_model != ctx.model:
                parsed["model"] = upstream_model
                changed = True
            if changed:
                body = orjson.dumps(parsed)
            headers = upstream_request_headers(request.headers,
                                               forward_auth=replica.cfg.forward_client_auth)
            headers["Content-Type"] = "application/json"
            headers["X-Request-Id"] = ctx.request_id
            if replica.api_key:
                headers.update(backends.backend_type(replica.cfg.type).auth_headers(
                    replica.api_key))
            url = replica.cfg.base_url + api.ROUTES[route]
            ctx.t_sent = now_ns()
            self.tracing.upstream_attempt(ctx, headers, replica.cfg.propagate_trace)
            try:
                up = await replica.session.post(url, data=body, headers=headers,
                                                trace_request_ctx=ctx)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise GatewayError(502, f"Backend '{replica.name}' is unreachable: "
                                   f"{type(e).__name__}.", "upstream_unreachable",
                                   outcome=UPSTREAM_ERROR) from None
            ctx.t_headers = now_ns()
            ctx.status = up.status
            extra = ((REQUEST_ID_HEADER, ctx.request_id),)
            ctype = up.headers.get("Content-Type", "")
            if up.status != 200 or not ctx.stream or not ctype.startswith("text/event-stream"):
                return await self._whole(request, ctx, up, api, extra)
            headers_out = client_response_headers(up.headers, event_stream=True, extra=extra)
            relay = Relay(request, ctx, up, api.StreamObserver(ctx), api, headers_out,
                          self.hold_until_first_token)
            return await relay.run()
        except GatewayError as e:
            ctx.finish(e.outcome, e.code)
            ctx.status = e.status
            return self._error(ctx, api, e)
        except (asyncio.CancelledError, ClientGone):
            ctx.cancel_phase = ctx.phase()
            ctx.finish(CLIENT_CANCELLED)
            if up is not None:
                up.close()  # close, not release: the engine must see the disconnect now
                up = None
            raise
        except Exception as e:  # a bug of ours: answer cleanly, keep serving
            ctx.finish(GATEWAY_ERROR, type(e).__name__)
            request.app.logger.exception("internal error on %s", route)
            if ctx.t_committed:
                raise  # the response has begun; aiohttp closes the connection
            return self._error(ctx, api, GatewayError(500, "Internal gateway error.",
                                                      "gateway_error", outcome=GATEWAY_ERROR))
        finally:
            if up is not None:
                if ctx.outcome == OK:
                    up.release()
                else:
                    up.close()
            self.metrics.in_flight.dec()
            self.finisher.finish(ctx, operation, provider)

    async def _whole(self, request: web.Request, ctx: RequestContext,
                     up: aiohttp.ClientResponse, api, extra) -> web.StreamResponse:
        """A response that is not an event stream (non-stream answer or an upstream error):
        read it whole and pass status, headers and body through."""
        body = await up.content.read(MAX_ERROR_BODY if up.status >= 400 else -1)
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
