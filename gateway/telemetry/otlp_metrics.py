"""OTLP metrics under the OpenTelemetry GenAI names (wire-and-telemetry.md §6.3), exported
when an OTLP endpoint is configured. Client metrics are the gateway's own measurements;
`gen_ai.server.*` only re-export what the provider reported (§6.4)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.config import TelemetryConfig
from gateway.errors import OK
from gateway.exchange import Exchange
from gateway.telemetry import durations as D
from gateway.telemetry.attribution import cache_bucket, prompt_bucket
from gateway.telemetry.tracing import _protocol, otlp_endpoint

if TYPE_CHECKING:  # the SDK is imported only when metrics are exported (~4 MiB less otherwise)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter

DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92, 163.84, 327.68, 655.36]
TOKEN_USAGE_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                       16777216, 67108864]
SERVER_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
SERVER_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]


def _exporter(cfg: TelemetryConfig, endpoint: str) -> MetricExporter:
    if _protocol(cfg, "metrics") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as G

        return G(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as H

    return H(endpoint=endpoint)


class OTLPMetrics:
    def __init__(self, cfg: TelemetryConfig, exporter: MetricExporter | None = None) -> None:
        self.chunk_metrics = cfg.otlp_chunk_metrics
        endpoint = otlp_endpoint(cfg, "metrics") if cfg.otlp_metrics else None
        self.provider: MeterProvider | None = None
        if exporter is None and endpoint is None:
            return
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        reader = PeriodicExportingMetricReader(
            exporter or _exporter(cfg, endpoint),  # type: ignore[arg-type]
            export_interval_millis=cfg.metrics_export_interval_s * 1000)
        self.provider = MeterProvider(metric_readers=[reader], resource=Resource.create(
            {"service.name": cfg.service_name}))
        meter = self.provider.get_meter("slogate")
        h = meter.create_histogram
        self.duration = h("gen_ai.client.operation.duration", "s",
                          "GenAI operation duration.",
                          explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.token_usage = h("gen_ai.client.token.usage", "{token}",
                             "Number of input and output tokens used.",
                             explicit_bucket_boundaries_advisory=TOKEN_USAGE_BUCKETS)
        self.first_chunk = h("gen_ai.client.operation.time_to_first_chunk", "s",
                             "Time to receive the first chunk of a streamed response.",
                             explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.ttft = h("slogate.time_to_first_token", "s",
                      "Streamed answers only: request received to first generated token (the "
                      "same TTFT as Prometheus' slogate_time_to_first_token_seconds).",
                      explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.per_chunk = h("gen_ai.client.operation.time_per_output_chunk", "s",
                           "Time between successive chunks of a streamed response.",
                           explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.server_ttft = h("gen_ai.server.time_to_first_token", "s",
                             "Provider-reported queue + prefill time.",
                             explicit_bucket_boundaries_advisory=SERVER_TTFT_BUCKETS)
        self.server_tpot = h("gen_ai.server.time_per_output_token", "s",
                             "Provider-reported decode time per output token after the first.",
                             explicit_bucket_boundaries_advisory=SERVER_TPOT_BUCKETS)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def record(self, ctx: Exchange, operation: str, provider: str) -> None:
        attrs: dict[str, Any] = {"gen_ai.operation.name": operation,
                                 "gen_ai.provider.name": provider,
                                 "gen_ai.request.model": ctx.model_label}
        if ctx.server_address:
            attrs["server.address"] = ctx.server_address
            attrs["server.port"] = ctx.server_port or 0
        if ctx.outcome != OK:
            attrs["error.type"] = ctx.error_type or ctx.outcome or "_OTHER"
        e2e = D.E2E.seconds(ctx)
        if e2e is not None:
            self.duration.record(e2e, attrs)
        if ctx.prompt_tokens is not None:
            self.token_usage.record(ctx.prompt_tokens, {**attrs, "gen_ai.token.type": "input"})
        if ctx.completion_tokens is not None:
            self.token_usage.record(ctx.completion_tokens,
                                    {**attrs, "gen_ai.token.type": "output"})
        first_chunk = D.FIRST_CHUNK.seconds(ctx)
        if first_chunk is not None:
            self.first_chunk.record(first_chunk, attrs)
            gaps = ctx.counted_gaps() if self.chunk_metrics else None
            if gaps is not None:
                # each gap at the middle of its Prometheus bucket (the stamps are not kept)
                for value, count in gaps.midpoints_s():
                    for _ in range(count):
                        self.per_chunk.record(value, attrs)
        ttft = D.TTFT.seconds(ctx)
        if ttft is not None:
            self.ttft.record(ttft, {**attrs, "slogate.slo_class": ctx.slo.name if ctx.slo else "",
                                    "slogate.prompt_length": prompt_bucket(ctx),
                                    "slogate.prefix_cache": cache_bucket(ctx)})
        if ctx.outcome == OK:
            if ctx.provider_queue_s is not None and ctx.provider_prefill_s is not None:
                self.server_ttft.record(ctx.provider_queue_s + ctx.provider_prefill_s, attrs)
            n = ctx.completion_tokens
            if ctx.provider_decode_s is not None and n and n > 1:
                self.server_tpot.record(ctx.provider_decode_s / (n - 1), attrs)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
