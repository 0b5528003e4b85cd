"""The configuration's model: frozen dataclasses, each default stated once, here.

`gateway.config.load` builds these from one TOML file plus environment overrides; nothing else
constructs them from user input.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 16 * 1024 * 1024
    # "first_token": hold the client's response headers until the first token (so a failure
    # before it can still become a clean error); "headers": commit when upstream headers arrive.
    commit: str = "first_token"
    access_log: bool = True  # one line per finished request on stderr
    # "json": every field, for a log pipeline; "text": one short line for a terminal.
    access_log_format: str = "json"
    # SIGTERM: /readyz turns false, listening stops after readiness_grace_s, in-flight requests
    # get up to drain_timeout_s, then streams end with an error event.
    drain_timeout_s: float = 30.0
    readiness_grace_s: float = 0.0
    # SSE comment pings while a committed stream is silent this long (0 = off). Before commit,
    # the first ping commits the response (failover is possible only before that).
    keepalive_s: float = 0.0
    # Listener limits (hostile clients): request headers must be complete this long after the
    # connection opened or the previous response ended (408, then close); the body must arrive
    # within body_timeout_s (408); an idle keep-alive connection is closed after
    # idle_connection_timeout_s; open connections are capped in total and per client address
    # (0 = no per-address cap: set it to 0 behind a proxy or load balancer). The caps are sized
    # above what one core streams (~1,000-2,000 paced streams), so that a host is limited by
    # its cores, not a default: one address may hold half of the connections (lower the
    # per-address cap where every client is a person's app holding a few).
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    idle_connection_timeout_s: float = 75.0
    max_connections: int = 8192
    max_connections_per_client: int = 4096
    # Connections the kernel completes and queues before the gateway accepts them, on every
    # listener (aiohttp's default of 128 loses SYNs in a burst of new connections: each waits
    # for a 1 s retransmit). The kernel caps it at net.core.somaxconn.
    backlog: int = 4096
    # Upstream limits (hostile upstreams): one SSE event, and what is held before the first
    # token, at most max_event_bytes; a non-streamed answer at most max_response_bytes
    # (decompressed).
    max_event_bytes: int = 8 * 1024 * 1024
    max_response_bytes: int = 32 * 1024 * 1024
    # A separate listener for /admin/* (0 = the main one). /metrics and the console move there
    # too when these say so. It has the main listener's header deadline and idle timeout, its
    # own connection cap (inside the same descriptor budget), and binds loopback unless
    # admin_host says otherwise: an admin surface is not for the public network by default.
    admin_port: int = 0
    admin_host: str = "127.0.0.1"
    admin_max_connections: int = 64
    # Host names the console answers besides IP literals, localhost and the listen host (it has
    # no key: an unknown Host is a DNS-rebinding page, 403); "*" = any.
    console_hosts: tuple[str, ...] = ()
    admin_metrics: bool = False
    admin_console: bool = False
    # Worker processes on one port (SO_REUSEPORT) under a supervisor (gateway/ops/workers.py): an
    # integer >= 1, or "auto" (the cores this process may use). `serve --workers` overrides it.
    workers: int | str = 1


@dataclass(frozen=True)
class Timeouts:
    """The four deadlines. A request may tighten them with x-slogate-timeout-<name>-ms
    headers, never extend them (deadlines.DeadlineOverrides)."""
    connect_s: float = 5.0  # TCP connect to the upstream
    first_token_s: float = 60.0  # upstream request sent -> first token (per attempt)
    idle_s: float = 60.0  # max gap between upstream events after the first token
    total_s: float = 600.0  # request received -> end


@dataclass(frozen=True)
class RetryPolicy:
    """Failures before commit go to the next replica (or fallback model)."""
    max_attempts: int = 3
    backoff_base_s: float = 0.05  # jittered exponential: random in [0, base * 2^n], capped
    backoff_max_s: float = 2.0
    retry_after_cap_s: float = 5.0  # an upstream Retry-After above this is not waited for
    budget_s: float = 0.0  # no new attempt starts this long after the request arrived
    #                        (0 = twice the first-token deadline of the request's backend)
    statuses: tuple[int, ...] = (429, 500, 502, 503, 504, 529)
    # A transient 5xx goes back to the same replica once (after the backoff) before another:
    # for engines whose 5xx is a passing hiccup and whose prefix cache is worth keeping.
    same_replica_first: bool = False
    # A committed stream cut or stalled after its first token may be finished this many times
    # by a backend with `continuation = "prefill"` (0 = never).
    max_continuations: int = 1
    # First-token races (SLO classes' hedge_after_ms) may add at most this share of extra
    # upstream requests per tenant.
    hedge_budget: float = 0.05


@dataclass(frozen=True)
class BreakerPolicy:
    # Failures (errors, timeouts) in a row that open a replica's breaker; one tenant's own
    # failures alone hold only that tenant off it (upstream/health.py).
    failures: int = 5
    cooldown_s: float = 10.0  # then one half-open probe request decides


@dataclass(frozen=True)
class AdmissionConfig:
    """SLO-aware admission control (off = plain pass-through)."""
    enabled: bool = False
    max_queue: int = 1024  # requests waiting for admission
    max_queue_tokens: int = 4_000_000  # estimated prompt tokens waiting
    max_concurrency: int = 256  # per replica, a hard safety net (a backend may set its own)
    forgetting: float = 0.97  # estimators' forgetting factor (lower adapts faster)
    # admit only if predicted + safety * σ (its tenant's robust spread of residuals) meets
    # the target
    safety: float = 1.0
    prefix_affinity: bool = False  # same prompt prefix -> same replica (engine prefix cache)
    prefix_bytes: int = 4096  # how much of the prompt's start is hashed for affinity
    affinity_slack: float = 0.5  # keep affinity while predicted TTFT <= best * (1 + slack)
    engine_metrics: bool = False  # scrape vllm:num_requests_waiting/running from backends
    engine_metrics_interval_s: float = 1.0
    redis_url: str = ""  # share in-flight and queued work across gateway processes
    redis_share: float = 1.0  # fraction of each cap this gateway keeps when Redis is down
    lease_s: float = 3.0  # a dead gateway's share is freed after this
    redis_timeout_s: float = 0.25  # one Redis call, connect included (its wait for a turn too)
    redis_pool_size: int = 16  # Redis connections, and calls in flight at once
    # Round trips (a moving average) above redis_slow_ms for redis_slow_for_s: admission goes
    # to the local share, as if Redis were down, until they are fast again.
    redis_slow_ms: float = 50.0
    redis_slow_for_s: float = 5.0
    # Learn each replica's useful concurrency (gradient on upstream TTFT, as Netflix's
    # concurrency-limits Gradient2 and Envoy's adaptive_concurrency filter), bounded above by
    # max_concurrency, so requests wait where they can be ordered: here, not in the engine.
    adaptive_concurrency: bool = True
    adaptive_initial: int = 8  # the limit before anything was learned
    adaptive_min: int = 2
    adaptive_tolerance: float = 2.0  # short-term TTFT may be this x the long-term one
    # An arrival of a class under its fair share whose turn at a slot comes too late may take
    # the slot of a running stream of a class over its own (admission/preemption.py); that
    # stream is continued when the next slot frees. Only streams a backend with
    # `continuation = "prefill"` can continue are preempted.
    preemption: bool = True


@dataclass(frozen=True)
class BackendConfig:
    name: str
    type: str
    base_url: str
    models: tuple[str, ...] = ("*",)
    aliases: Mapping[str, str] = field(default_factory=dict)
    api_key_env: str | None = None
    pool_size: int = 4096  # upstream connections (one per stream in flight), at most
    forward_client_auth: bool = False
    # Send our trace context upstream (so vLLM's span joins our trace). Off for hosted APIs:
    # it would leak internal ids to a third party.
    propagate_trace: bool = True
    # gen_ai.provider.name in telemetry (e.g. "vllm", "sglang", "openai"); defaults to the type.
    provider: str = ""
    timeouts: Timeouts = field(default_factory=Timeouts)
    health_path: str = ""  # active health check: GET base_url's origin + this path
    health_interval_s: float = 5.0
    max_concurrency: int = 0  # admission's per-replica cap (0 = [admission].max_concurrency)
    # send max_completion_tokens as max_tokens (llama.cpp's server ignores the newer name)
    rename_max_completion_tokens: bool = False
    # Header policy (gateway/edge/headers.py): client headers dropped by default that this backend
    # gets anyway (e.g. "OpenAI-Organization"), and forwarded ones it must not get
    # (e.g. "anthropic-beta").
    forward_headers: tuple[str, ...] = ()
    deny_headers: tuple[str, ...] = ()
    # "prefill": it can finish another replica's answer cut short, given the text so far as
    # an assistant message to continue (vLLM and SGLang's continue_final_message; llama.cpp
    # likewise). "" (default): it is never sent a prefill.
    continuation: str = ""

    @property
    def wildcard(self) -> bool:
        return "*" in self.models

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(frozen=True)
class Quotas:
    """A tenant's quotas (0 = none). Tokens are prompt + completion: an estimate is reserved
    at admission and settled from the reported usage when the answer ends."""
    max_in_flight: int = 0
    max_queued: int = 0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0

    @property
    def any(self) -> bool:
        return bool(self.max_in_flight or self.max_queued or self.requests_per_minute
                    or self.tokens_per_minute)


@dataclass(frozen=True)
class TenantPolicy:
    """What a tenant's key decides: the SLO classes it may use (the first is its default;
    none listed = only its route's class, or every class in open mode), whether it may send
    x-slo-* and x-slogate-timeout-* overrides and within which bounds, its weight under
    contention and its quotas. Safe defaults: no overrides, no class chosen by header."""
    classes: tuple[str, ...] = ()
    any_class: bool = False  # open mode without `classes`: x-slo-class may pick any class
    slo_overrides: bool = False
    timeout_overrides: bool = False
    override_min_ms: float = 1.0  # bounds of x-slo-ttft-ms / x-slo-tpot-ms
    override_max_ms: float = 60_000.0
    weight: float = 1.0
    quotas: Quotas = field(default_factory=Quotas)


OPEN_POLICY = TenantPolicy(any_class=True)  # open mode's defaults


@dataclass(frozen=True)
class GatewayKey:
    """One [[auth.keys]] entry: a tenant's key, known only by its sha256, and its policy."""
    tenant: str
    sha256: str
    models: tuple[str, ...] = ("*",)
    policy: TenantPolicy = field(default_factory=TenantPolicy)


@dataclass(frozen=True)
class AdminKey:
    """One [[auth.admin_keys]] entry: who may read /admin/*, known only by its sha256."""
    name: str
    sha256: str


@dataclass(frozen=True)
class AuthConfig:
    mode: str  # "keys" or "open" (open must be chosen explicitly)
    keys: Mapping[str, GatewayKey] = field(default_factory=dict)  # sha256 hex -> key
    # Open mode: the one policy every request gets (the same knobs as a key's).
    open_policy: TenantPolicy = OPEN_POLICY
    admin_keys: Mapping[str, AdminKey] = field(default_factory=dict)  # sha256 hex -> admin key

    def tenants(self) -> tuple[str, ...]:
        """The configured tenant names (metric labels: these and `other`)."""
        return tuple(dict.fromkeys(k.tenant for k in self.keys.values()))


@dataclass(frozen=True)
class SLOClass:
    name: str
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float | None = None
    priority: int = 0  # higher is more important (admission uses it)
    weight: float = 1.0  # its share among classes of the same priority under contention
    # The least share of dispatches it keeps under contention, whatever the priorities.
    min_share: float = 0.05
    # The first-token race: a stream still without its first token this long after it was sent
    # gets a second attempt on another replica; the first to produce a token is the answer
    # (None: off; "auto": the class's live P95 TTFT).
    hedge_after_ms: float | Literal["auto"] | None = None


DEFAULT_CLASS = SLOClass(name="default", ttft_ms=1000.0, tpot_ms=100.0)


@dataclass(frozen=True)
class SLOTarget:
    """The targets one request is judged against: its class, possibly tightened or loosened by
    request headers within the configured bounds."""
    cls: SLOClass
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float | None

    @property
    def name(self) -> str:
        return self.cls.name


@dataclass(frozen=True)
class SLOConfig:
    classes: Mapping[str, SLOClass] = field(
        default_factory=lambda: {DEFAULT_CLASS.name: DEFAULT_CLASS})
    default: str = DEFAULT_CLASS.name
    route_classes: Mapping[str, str] = field(default_factory=dict)
    # Bounds for per-request header overrides, in ms.
    min_ms: float = 1.0
    max_ms: float = 600_000.0
    allow_header_overrides: bool = True

    def thresholds_s(self) -> list[float]:
        """Every configured threshold, in seconds (they must be histogram bucket bounds)."""
        out: set[float] = set()
        for c in self.classes.values():
            out.update(v / 1e3 for v in (c.ttft_ms, c.tpot_ms, c.e2e_ms) if v)
        return sorted(out)


@dataclass(frozen=True)
class TelemetryConfig:
    # OTLP endpoint for traces and metrics; empty = the standard OTEL_EXPORTER_OTLP_* variables
    # decide, and with none of them set nothing is exported.
    otlp_endpoint: str = ""
    otlp_protocol: str = "http/protobuf"
    service_name: str = "slogate"
    traces: bool = True
    otlp_metrics: bool = True
    metrics_export_interval_s: float = 15.0
    prometheus: bool = True  # GET /metrics
    capture_content: bool = False  # prompts/completions in spans: only if the operator opts in
    # Share of traces recorded when the caller did not decide (its traceparent's sampled flag
    # wins); OTEL_TRACES_SAMPLER, if set, overrides this.
    trace_sample_ratio: float = 1.0
    # gen_ai.client.operation.time_per_output_chunk, one OTLP observation per chunk: costly in
    # the OTel SDK (~10 µs each), and Prometheus has inter_token_latency_seconds anyway.
    otlp_chunk_metrics: bool = False


@dataclass(frozen=True)
class RecorderConfig:
    """The flight recorder of admission and routing decisions (GET /admin/decisions)."""
    enabled: bool = True
    ring_size: int = 2000  # the newest decisions kept in memory (~1 KiB each)
    # Also append each decision as a JSON line to this file (empty: memory only); rotated at
    # max_bytes, keeping `backups` older files (path.1 … path.N).
    path: str = ""
    max_bytes: int = 64 * 1024 * 1024
    backups: int = 5


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    backends: tuple[BackendConfig, ...]
    auth: AuthConfig
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    # model -> models to try, in order, when every replica of it failed before commit
    fallbacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # model -> larger-context models for a request it answered "too long for my context"
    context_fallbacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    recorder: RecorderConfig = field(default_factory=RecorderConfig)
