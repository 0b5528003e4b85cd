"""The Exchange (one per request: its facts and its timeline of monotonic-ns stamps) and the
Attempt (one per upstream try).

Every phase writes into the exchange; nothing else keeps per-request state. Telemetry (spans,
metrics, the access log) is produced once, in `finish`, from the finished exchange, so the hot
path pays only for integer stores. The timeline's upstream stamps (t_sent … t_last_token) are
those of the current attempt: a failed attempt is moved to `attempts` with its own times and the
stamps start again for the next one.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway.apis.base import EventInfo
from gateway.timeline import BATCH, Gaps, now_ns

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.apis.base import Api, Provider
    from gateway.config import GatewayKey, SLOTarget, TenantPolicy, Timeouts
    from gateway.errors import AttemptFailed
    from gateway.transport.client import UpstreamResponse
    from gateway.upstream.routing import Replica

def new_request_id() -> str:
    """A random UUID: also sent upstream as X-Request-Id, and some servers (llama.cpp's, via
    starlette-context) answer 400 to an X-Request-Id that is not a UUID."""
    b = bytearray(os.urandom(16))
    b[6] = b[6] & 0x0F | 0x40  # version 4
    b[8] = b[8] & 0x3F | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# A replica admission weighed for a request: (name, predicted TTFT s or None, in flight,
# limit, why not; "" where both targets held).
Candidate = tuple[str, float | None, int, int, str]
MAX_CANDIDATES = 8  # replicas kept per request: the record stays small however many there are


class Lease(Protocol):
    """Admission's claim on a replica for one request (admission.controller.Ticket)."""

    @property
    def replica(self) -> Replica: ...
    @property
    def model(self) -> str: ...
    def first_token(self) -> None: ...
    def move(self, replica: Replica) -> None: ...
    def finish(self, ctx: Exchange) -> None: ...


@dataclass(eq=False)
class Attempt:
    """One upstream try: where it went, what was sent, and — once it has ended before
    commit — how it failed."""
    replica: Replica
    upstream_model: str
    timeouts: Timeouts
    provider: Provider
    probe: bool = False  # it holds a probe of its replica's breaker (a trial of its health)
    tenant: str = ""  # whose request (the bounded label): the breaker judges each tenant apart
    t_sent: int = 0
    t_end: int = 0
    result: str = ""  # upstream_attempts_total{result} once decided
    status: int = 0
    span: Any = None  # its CLIENT span, ended when it failed
    response: UpstreamResponse | None = field(default=None, repr=False)

    @property
    def backend(self) -> str:
        return self.replica.name

    def close(self) -> None:
        """Drop the upstream connection now (not back to the pool): the engine must see the
        disconnect at once."""
        if self.response is not None:
            self.response.close()
            self.response = None


class Exchange:
    __slots__ = (
        # facts
        "request_id", "route", "model", "upstream_model", "stream", "backend",
        "usage_injected", "status",
        # timeline (monotonic ns; 0 = did not happen)
        "t_received", "t_body", "t_sent", "t_headers", "t_first_event", "t_first_token",
        "t_first_visible", "t_last_token", "t_committed", "t_end",
        # counts and what the stream said
        "events", "token_events", "prompt_tokens", "completion_tokens", "usage_source",
        "cached_tokens", "cache_write_tokens",
        "finish_reasons", "response_id", "response_model", "done", "error_type",
        "outcome", "cancel_phase",
        # telemetry inputs
        "token_ns", "gaps", "gap_bounds_ns", "overhead_ns", "client_paused_ns", "t_connect_start",
        "t_connect_end",
        "provider_queue_s", "provider_prefill_s", "provider_decode_s",
        "provider_prefill_inferred", "slo", "verdict", "model_label",
        "interruption", "trace", "server_address", "server_port", "tenant", "tenant_label",
        "policy", "served_model",
        "admission", "t_queued", "t_admitted", "t_last_event", "t_dispatched", "attempts",
        "on_first_token", "candidates", "estimated_tokens", "predicted_wait_s",
        "predicted_ttft_s",
        # the phases' working state
        "api", "operation", "key", "body", "parsed", "attempt", "ticket", "response",
        "retry_budget_at", "last_failure", "too_long_for", "streamed_text", "continued_from",
        "preempted", "captured_output", "race", "hedge",
    )

    def __init__(self, route: str, gap_bounds_ns: tuple[int, ...] = ()) -> None:
        self.t_received = now_ns()
        self.request_id = new_request_id()
        self.route = route
        self.model: str | None = None
        self.upstream_model: str | None = None
        self.stream = False
        self.backend: str | None = None
        self.usage_injected = False
        self.status = 0
        self.t_body = self.t_sent = self.t_headers = self.t_first_event = 0
        self.t_first_token = self.t_first_visible = self.t_last_token = 0
        self.t_committed = self.t_end = 0
        self.events = 0
        self.token_events = 0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.usage_source: str | None = None  # "upstream" or "counted" (token events)
        self.cached_tokens: int | None = None  # of prompt_tokens: from the prefix cache
        self.cache_write_tokens: int | None = None  # of prompt_tokens: written to it
        self.finish_reasons: list[str] = []
        self.response_id: str | None = None
        self.response_model: str | None = None
        self.done = False  # the protocol terminator was seen
        self.error_type: str | None = None
        self.outcome: str | None = None
        self.cancel_phase: str | None = None
        # Gaps between token events, counted into the ITL histogram's buckets in batches of
        # token stamps: bounded memory however long the stream (gateway/timeline.py).
        self.token_ns: list[int] = []
        self.gaps: Gaps | None = None
        self.gap_bounds_ns = gap_bounds_ns
        self.overhead_ns = 0  # time in gateway code while relaying
        # Time the upstream was paused because the client read slower than it wrote: the
        # stream's TPOT then says how fast the client read, not how fast the engine decoded.
        self.client_paused_ns = 0
        self.t_connect_start = self.t_connect_end = 0
        self.provider_queue_s: float | None = None  # provider-reported stages (seconds)
        self.provider_prefill_s: float | None = None
        self.provider_decode_s: float | None = None
        self.provider_prefill_inferred = False  # computed from other reported numbers
        self.slo: SLOTarget | None = None
        self.verdict: str | None = None
        self.model_label = "other"  # bounded model label for metrics
        self.interruption: str | None = None  # why a committed stream ended with an error event
        self.trace: Any = None  # telemetry.tracing.RequestSpans when tracing is on
        self.server_address: str | None = None
        self.server_port: int | None = None
        self.tenant: str | None = None  # from the gateway key (logs)
        self.tenant_label = "other"  # bounded metric label: a configured tenant, or `other`
        self.policy: TenantPolicy | None = None  # the request runs under it
        self.served_model: str | None = None  # the client-visible model an attempt served
        self.admission: tuple[str, str] | None = None  # (decision, reason)
        self.t_queued = 0  # entered the admission queue (0: never queued)
        self.predicted_wait_s: float | None = None  # admission's predicted queue wait
        # ... and TTFT from received, padded by the stated error, where a refusal found the
        # best case too late for the target
        self.predicted_ttft_s: float | None = None
        self.t_admitted = 0  # left the admission queue (0: never queued)
        self.t_last_event = 0  # last upstream SSE event (idle deadline)
        self.t_dispatched = 0  # first upstream attempt sent (end of the gateway queue)
        self.attempts: list[Attempt] = []  # earlier upstream attempts that failed before commit
        self.on_first_token: Callable[[], None] | None = None  # admission, at the first token
        # the replicas admission weighed (considered(); None: none), read by the decision log
        self.candidates: list[Candidate] | None = None
        self.estimated_tokens: float | None = None  # admission's estimate of prompt tokens
        self.api: Api | None = None  # the client's API adapter (from the route table)
        self.operation = "chat"
        self.key: GatewayKey | None = None  # None in open mode
        self.body = b""  # the client's request body, as received
        self.parsed: dict[str, Any] = {}
        self.attempt: Attempt | None = None  # the current upstream try
        self.ticket: Lease | None = None  # while admitted
        self.response: web.StreamResponse | None = None  # the client response, once committed
        self.retry_budget_at = 0  # no new attempt starts after this (monotonic ns)
        self.last_failure: AttemptFailed | None = None  # of the latest failed attempt
        # models that said the prompt exceeds their context (a tuple: most requests have none)
        self.too_long_for: tuple[str, ...] = ()
        # Mid-stream continuation: the text the client got so far, kept only for a stream that
        # may be continued if it breaks (None: it may not), and the token count at each
        # continuation.
        self.streamed_text: list[str] | None = None
        self.continued_from: tuple[int, ...] = ()
        self.preempted = 0  # of those continuations, the ones admission asked for (a slot given)
        self.captured_output: list[str] | None = None  # output text, content capture only
        self.race: Any = None  # request.hedge.Race while a first-token race may run
        self.hedge: str | None = None  # how its race ended (won, lost, failed, abandoned)

    def fork(self) -> Exchange:
        """A hedge's own record: the request's facts, an upstream timeline of its own, and the
        attempts so far (the one in flight too) as tried, so that it goes elsewhere. Its own
        request id: an engine must not see two live requests with one id."""
        f = Exchange(self.route, self.gap_bounds_ns)
        f.t_received = self.t_received
        for name in ("model", "stream", "api", "operation", "key", "body", "parsed", "tenant",
                     "tenant_label", "policy", "slo", "model_label", "retry_budget_at",
                     "too_long_for", "t_dispatched"):
            setattr(f, name, getattr(self, name))
        f.attempts = [*self.attempts, *((self.attempt,) if self.attempt is not None else ())]
        if self.trace is not None:  # the same request's spans, its own attempt span
            f.trace = copy.copy(self.trace)
            f.trace.upstream = None
        return f

    def adopt(self, fork: Exchange) -> None:
        """A hedge won: its attempt and what its send stamped become the request's (the reads
        it recorded are replayed into the relay, which stamps the rest)."""
        self.attempt = fork.attempt
        for name in ("backend", "server_address", "server_port", "upstream_model",
                     "served_model", "t_sent", "t_headers", "status", "usage_injected",
                     "t_connect_start", "t_connect_end"):
            setattr(self, name, getattr(fork, name))
        if self.trace is not None and fork.trace is not None:
            self.trace.upstream = fork.trace.upstream

    def _close_attempt(self, result: str, span: Any) -> None:
        """The current attempt, with its own times and result, goes to `attempts`."""
        a = self.attempt
        if a is not None:
            a.t_sent, a.t_end, a.result, a.status, a.span = (self.t_sent, now_ns(), result,
                                                             self.status, span)
            self.attempts.append(a)
            self.attempt = None

    def continuing(self, result: str, span: Any) -> None:
        """Record the current attempt, committed and broken, as done with: the next one
        continues its answer. What the client already has (first token, token stamps, the
        answer's id) stays; what the next attempt reports starts again."""
        self._close_attempt(result, span)
        self.continued_from = (*self.continued_from, self.token_events)
        self.prompt_tokens = self.completion_tokens = None
        self.usage_source = None
        self.finish_reasons = []
        self.done = False
        self.error_type = None
        self.interruption = None

    def attempt_failed(self, result: str, span: Any) -> None:
        """Record the current attempt as failed and clear what it observed, so the next one
        starts a clean upstream timeline."""
        self._close_attempt(result, span)
        self.t_sent = self.t_headers = self.t_first_event = self.t_first_token = 0
        self.t_first_visible = self.t_last_token = self.t_last_event = 0
        self.t_connect_start = self.t_connect_end = 0
        self.events = self.token_events = 0
        self.token_ns = []
        self.gaps = None
        self.prompt_tokens = self.completion_tokens = None
        self.cached_tokens = self.cache_write_tokens = None
        self.usage_source = None
        self.finish_reasons = []
        self.response_id = self.response_model = None
        self.done = False
        self.error_type = None
        self.status = 0
        self.usage_injected = False
        self.provider_queue_s = self.provider_prefill_s = self.provider_decode_s = None
        self.provider_prefill_inferred = False

    def considered(self, replica: str, predicted_ttft_s: float | None, in_flight: int,
                   limit: int, why: str) -> None:
        """Admission weighed `replica` for this request: its latest look at each replica is
        kept (a queued request is weighed again on every pass), at most MAX_CANDIDATES."""
        row = (replica, predicted_ttft_s, in_flight, limit, why)
        rows = self.candidates
        if rows is None:
            self.candidates = [row]
            return
        for i, old in enumerate(rows):
            if old[0] == replica:
                rows[i] = row
                return
        if len(rows) < MAX_CANDIDATES:
            rows.append(row)

    # -- what the upstream said: one place stamps the timeline from an adapter's EventInfo ----
    def event_seen(self, info: EventInfo, t: int) -> None:
        """Stamp one upstream event observed at `t` (an API adapter's `observe` said what it
        is; only this writes it into the timeline)."""
        self.events += 1
        if not self.t_first_event:
            self.t_first_event = t
        if info.token:
            self.token_events += 1
            stamps = self.token_ns
            stamps.append(t)
            if len(stamps) > BATCH:
                self.counted_gaps()
            self.t_last_token = t
            if not self.t_first_token:
                self.t_first_token = t
            if info.visible and not self.t_first_visible:
                self.t_first_visible = t
        if info.has_facts:
            self.read_facts(info)

    def read_facts(self, info: EventInfo) -> None:
        """Usage, ids, finish reasons, errors and provider timings from an event or a whole
        response."""
        if info.done:
            self.done = True
        if info.error_type is not None:
            self.error_type = info.error_type
        if info.response_id is not None and self.response_id is None:
            self.response_id = info.response_id
            self.response_model = info.response_model
        if info.prompt_tokens is not None:
            self.prompt_tokens = info.prompt_tokens
        if info.completion_tokens is not None:
            self.completion_tokens = info.completion_tokens
            self.usage_source = "upstream"
        if info.cached_tokens is not None:
            self.cached_tokens = info.cached_tokens
        if info.cache_write_tokens is not None:
            self.cache_write_tokens = info.cache_write_tokens
        if info.finish_reasons:
            self.finish_reasons.extend(info.finish_reasons)
        timing = info.timing
        if timing is not None:
            self.provider_queue_s = timing.queue_s
            self.provider_prefill_s = timing.prefill_s
            self.provider_decode_s = timing.decode_s
            self.provider_prefill_inferred = timing.prefill_inferred

    @property
    def target(self) -> SLOTarget:
        """The SLO target, for the phases after classify (which always sets it)."""
        assert self.slo is not None, "read before classify"
        return self.slo

    @property
    def tenant_policy(self) -> TenantPolicy:
        """The tenant's policy, for the phases after authenticate (which always sets it)."""
        assert self.policy is not None, "read before authenticate"
        return self.policy

    # -- where it is, and its end ----------------------------------------------------------------
    def phase(self) -> str:
        """Where the request is now: used to label a cancellation."""
        if not self.t_sent:
            return "queued"
        if not self.t_first_token:
            return "prefill"
        return "decode"

    def finish(self, outcome: str, error_type: str | None = None) -> None:
        if self.outcome is None:
            self.outcome = outcome
            if error_type:
                self.error_type = error_type
        if not self.t_end:
            self.t_end = now_ns()
        if self.completion_tokens is None and self.stream and self.token_events:
            self.completion_tokens = self.token_events
            self.usage_source = "counted"

    def counted_gaps(self) -> Gaps | None:
        """The gaps between this attempt's token events, all counted (None: fewer than two)."""
        stamps = self.token_ns
        if len(stamps) > 1:
            gaps = self.gaps
            if gaps is None:
                gaps = self.gaps = Gaps(self.gap_bounds_ns)
            gaps.take(stamps)
        return self.gaps
