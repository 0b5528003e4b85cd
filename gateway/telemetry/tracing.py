"""OpenTelemetry spans for each request, built from its timeline.

The SERVER span and the upstream CLIENT span are started when their work starts (the CLIENT
span's context is what goes upstream in `traceparent`, so vLLM's `llm_request` span becomes its
child); everything else — stage spans, events, attributes — is created at the end from the
finished timeline with explicit start/end times. Nothing per token.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config import TelemetryConfig
from gateway.errors import OK
from gateway.exchange import Exchange
from gateway.telemetry import durations as D
from gateway.telemetry.attribution import TTFTSplit, cache_bucket, prompt_bucket

if TYPE_CHECKING:  # the SDK is imported only when spans are exported (~4 MiB less otherwise)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

# Monotonic stamps → wall-clock ns for span times (the timeline is monotonic on purpose).
_EPOCH_OFFSET = time.time_ns() - time.monotonic_ns()
_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = ("traceparent", "tracestate")


def epoch_ns(t: int) -> int:
    return t + _EPOCH_OFFSET


def otlp_endpoint(cfg: TelemetryConfig, signal: str) -> str | None:
    """Where to export `signal` ("traces"/"metrics"), or None if nothing is configured."""
    if cfg.otlp_endpoint:
        base = cfg.otlp_endpoint.rstrip("/")
        return base if cfg.otlp_protocol == "grpc" else f"{base}/v1/{signal}"
    specific = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if specific:
        return specific
    generic = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if generic:
        base = generic
        proto = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", cfg.otlp_protocol)
        return base.rstrip("/") if proto == "grpc" else f"{base.rstrip('/')}/v1/{signal}"
    return None


def _protocol(cfg: TelemetryConfig, signal: str) -> str:
    if cfg.otlp_endpoint:
        return cfg.otlp_protocol
    return (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or cfg.otlp_protocol)


def _span_exporter(cfg: TelemetryConfig, endpoint: str) -> SpanExporter:
    if _protocol(cfg, "traces") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=endpoint)


class RequestSpans:
    """The live spans of one request."""

    __slots__ = ("server", "server_ctx", "upstream", "trace_id", "sampled")

    def __init__(self, server: trace.Span, server_ctx: Context) -> None:
        self.server = server
        self.server_ctx = server_ctx
        self.upstream: trace.Span | None = None
        span_ctx = server.get_span_context()
        self.trace_id = format(span_ctx.trace_id, "032x")
        self.sampled = span_ctx.trace_flags.sampled


class Tracing:
    def __init__(self, cfg: TelemetryConfig, exporter: SpanExporter | None = None) -> None:
        self.capture_content = cfg.capture_content
        endpoint = otlp_endpoint(cfg, "traces") if cfg.traces else None
        self.provider: TracerProvider | None = None
        if exporter is None and endpoint is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        sampler = None
        if not os.environ.get("OTEL_TRACES_SAMPLER"):
            sampler = ParentBased(TraceIdRatioBased(cfg.trace_sample_ratio))
        self.provider = TracerProvider(sampler=sampler, resource=Resource.create(
            {"service.name": cfg.service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter or _span_exporter(cfg, endpoint)))  # type: ignore[arg-type]
        self.tracer = self.provider.get_tracer("slogate")

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def start(self, ctx: Exchange, headers: Mapping[str, str], operation: str) -> None:
        """The SERVER span, joining the caller's trace if it sent a valid `traceparent`."""
        parent = _PROPAGATOR.extract(headers)
        span = self.tracer.start_span(f"{operation} {ctx.model}", context=parent,
                                      kind=SpanKind.SERVER, start_time=epoch_ns(ctx.t_received))
        ctx.trace = RequestSpans(span, trace.set_span_in_context(span, parent))

    def upstream_attempt(self, ctx: Exchange, out_headers: Any, propagate: bool) -> None:
        """Start the CLIENT span for an upstream attempt and put its context in the upstream
        request's headers (or strip trace headers when this backend must not see them)."""
        spans = ctx.trace
        if spans is None:
            if not propagate:  # tracing off: the caller's context passes through, if allowed
                for name in TRACE_HEADERS:
                    out_headers.pop(name, None)
            return
        for name in TRACE_HEADERS:
            out_headers.pop(name, None)
        span = self.tracer.start_span("upstream", context=spans.server_ctx, kind=SpanKind.CLIENT,
                                      start_time=epoch_ns(ctx.t_sent))
        spans.upstream = span
        if propagate:
            _PROPAGATOR.inject(out_headers, context=trace.set_span_in_context(span))

    def end_attempt(self, ctx: Exchange, result: str) -> Any:
        """End the current attempt's CLIENT span as failed (the next attempt is its
        sibling)."""
        spans: RequestSpans | None = ctx.trace
        if spans is None or spans.upstream is None:
            return None
        span, spans.upstream = spans.upstream, None
        attrs: dict[str, Any] = {"error.type": result, "slogate.backend": ctx.backend or ""}
        if ctx.status:
            attrs["http.response.status_code"] = ctx.status
        if ctx.server_address:
            attrs["server.address"] = ctx.server_address
            attrs["server.port"] = ctx.server_port or 0
        span.set_attributes(attrs)
        span.set_status(Status(StatusCode.ERROR, result))
        span.end(end_time=epoch_ns(time.monotonic_ns()))
        return span

    def finish(self, ctx: Exchange, operation: str, provider: str,
               split: TTFTSplit | None) -> None:
        spans: RequestSpans | None = ctx.trace
        if spans is None:
            return
        end = epoch_ns(ctx.t_end or time.monotonic_ns())
        server = spans.server
        if not server.is_recording():  # not sampled: nothing to build
            if spans.upstream is not None:
                spans.upstream.end(end_time=end)
            server.end(end_time=end)
            return
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": ctx.model or "",
            "gen_ai.request.stream": ctx.stream,
            "slogate.outcome": ctx.outcome or "",
            "slogate.request_id": ctx.request_id,
        }
        if ctx.backend:
            attrs["slogate.backend"] = ctx.backend
        if ctx.server_address:
            attrs["server.address"] = ctx.server_address
            attrs["server.port"] = ctx.server_port or 0
        if ctx.response_model:
            attrs["gen_ai.response.model"] = str(ctx.response_model)
        if ctx.response_id:
            attrs["gen_ai.response.id"] = str(ctx.response_id)
        if ctx.finish_reasons:
            attrs["gen_ai.response.finish_reasons"] = [str(r) for r in ctx.finish_reasons]
        if ctx.prompt_tokens is not None:
            attrs["gen_ai.usage.input_tokens"] = ctx.prompt_tokens
            attrs["slogate.prompt_length"] = prompt_bucket(ctx)
            attrs["slogate.prefix_cache"] = cache_bucket(ctx)
        if ctx.cached_tokens is not None:
            attrs["gen_ai.usage.cache_read.input_tokens"] = ctx.cached_tokens
        if ctx.cache_write_tokens is not None:
            attrs["gen_ai.usage.cache_creation.input_tokens"] = ctx.cache_write_tokens
        if ctx.completion_tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = ctx.completion_tokens
            attrs["slogate.usage.source"] = ctx.usage_source or ""
        if ctx.slo is not None:
            attrs["slogate.slo_class"] = ctx.slo.name
        if ctx.verdict:
            attrs["slogate.slo.verdict"] = ctx.verdict
        ttft = D.TTFT.seconds(ctx)
        if ttft is not None:
            attrs["slogate.ttft_ms"] = round(ttft * 1e3, 3)
        first_chunk = D.FIRST_CHUNK.seconds(ctx)
        if first_chunk is not None:
            attrs["gen_ai.response.time_to_first_chunk"] = first_chunk
        if split is not None:
            # The TTFT's stages under the dashboard's names (they add up to slogate.ttft_ms),
            # and where each number came from: measured, provider or inferred.
            for stage, ms in split.ms().items():
                attrs[f"slogate.ttft.{stage}_ms"] = ms
                attrs[f"slogate.ttft.{stage}.source"] = split.sources[stage]
            attrs["slogate.ttft.largest_stage"] = split.largest
            if split.missed:
                attrs["slogate.ttft.miss_stage"] = split.largest
        tpot = D.tpot_s(ctx)
        if tpot is not None:
            attrs["slogate.tpot_ms"] = round(tpot * 1e3, 3)
        if ctx.outcome != OK:
            attrs["error.type"] = ctx.error_type or ctx.outcome or "_OTHER"
            server.set_status(Status(StatusCode.ERROR, ctx.outcome))
        if self.capture_content:
            attrs.update(captured_content(ctx))
        server.set_attributes(attrs)
        for name, t in (("first_event", ctx.t_first_event), ("first_token", ctx.t_first_token),
                        ("first_visible", ctx.t_first_visible), ("last_token", ctx.t_last_token)):
            if t:
                server.add_event(name, timestamp=epoch_ns(t))

        def child(name: str, parent_ctx: Context, a: int, b: int,
                  extra: dict[str, Any] | None = None) -> None:
            if a and b and b >= a:
                s = self.tracer.start_span(name, context=parent_ctx, start_time=a,
                                           attributes=extra)
                s.end(end_time=b)

        if D.GATEWAY_QUEUE.ns(ctx) is not None:
            child("gateway.queue", spans.server_ctx, epoch_ns(ctx.t_received),
                  epoch_ns(ctx.t_dispatched))
        if D.ADMISSION_WAIT.ns(ctx) is not None:
            child("gateway.admission_wait", spans.server_ctx, epoch_ns(ctx.t_queued),
                  epoch_ns(ctx.t_admitted))
        up = spans.upstream
        if up is not None:
            up_ctx = trace.set_span_in_context(up)
            up_attrs: dict[str, Any] = {"gen_ai.operation.name": operation,
                                        "gen_ai.provider.name": provider,
                                        "slogate.backend": ctx.backend or ""}
            if ctx.server_address:
                up_attrs["server.address"] = ctx.server_address
                up_attrs["server.port"] = ctx.server_port or 0
            if ctx.status:
                up_attrs["http.response.status_code"] = ctx.status
            if ctx.outcome != OK and ctx.outcome is not None:
                up_attrs["error.type"] = ctx.error_type or ctx.outcome
                up.set_status(Status(StatusCode.ERROR, ctx.outcome))
            up.set_attributes(up_attrs)
            measured = {"slogate.timing.source": "gateway"}
            if D.UPSTREAM_CONNECT.ns(ctx) is not None:
                child("upstream.connect", up_ctx, epoch_ns(ctx.t_connect_start),
                      epoch_ns(ctx.t_connect_end), measured)
            if D.UPSTREAM_HEADERS.ns(ctx) is not None:
                child("upstream.headers", up_ctx, epoch_ns(ctx.t_sent),
                      epoch_ns(ctx.t_headers), measured)
            if D.TTFT.ns(ctx) is not None and ctx.t_headers:
                child("upstream.first_token_after_headers", up_ctx, epoch_ns(ctx.t_headers),
                      epoch_ns(ctx.t_first_token), measured)
            decode = D.DECODE.ns(ctx)
            if decode:
                child("upstream.decode", up_ctx, epoch_ns(ctx.t_first_token),
                      epoch_ns(ctx.t_last_token), measured)
            self._provider_spans(ctx, up_ctx, child)
            up.end(end_time=end)
        server.end(end_time=end)

    @staticmethod
    def _provider_spans(ctx: Exchange, up_ctx: Context,
                        child: Callable[[str, Context, int, int, dict[str, Any]], None]) -> None:
        """Stages the provider reported, placed on our timeline: its prefill ends where we saw
        the first token, its queue ends where its prefill starts, its decode starts at the
        first token. Only what was reported; no split is invented."""
        if D.TTFT.ns(ctx) is None:
            return
        source = {"slogate.timing.source": "provider",
                  "slogate.timing.anchor": "gateway_first_token"}
        first = epoch_ns(ctx.t_first_token)
        prefill = ctx.provider_prefill_s
        queue_end = first
        if prefill is not None:
            queue_end = first - int(prefill * 1e9)
            child("provider.prefill", up_ctx, queue_end, first,
                  {**source, "slogate.timing.inferred": True} if ctx.provider_prefill_inferred
                  else source)
        if ctx.provider_queue_s is not None and prefill is not None:
            child("provider.queue", up_ctx, queue_end - int(ctx.provider_queue_s * 1e9),
                  queue_end, source)
        if ctx.provider_decode_s is not None:
            child("provider.decode", up_ctx, first, first + int(ctx.provider_decode_s * 1e9),
                  source)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


CAPTURE_LIMIT = 16 * 1024  # characters of prompt and of output kept per span


def captured_content(ctx: Exchange) -> dict[str, str]:
    """Opt-in content capture (`[telemetry] capture_content`): the prompt's messages (or
    input, prompt, system) and the output text, each cut at CAPTURE_LIMIT characters, as the
    GenAI conventions' `gen_ai.input.messages` / `gen_ai.output.messages` attributes."""
    out: dict[str, str] = {}
    body = ctx.parsed
    prompt = {k: body[k] for k in ("system", "instructions", "messages", "input", "prompt")
              if k in body}
    if prompt:
        out["gen_ai.input.messages"] = orjson.dumps(prompt).decode()[:CAPTURE_LIMIT]
    if ctx.captured_output:
        out["gen_ai.output.messages"] = "".join(ctx.captured_output)[:CAPTURE_LIMIT]
    return out
