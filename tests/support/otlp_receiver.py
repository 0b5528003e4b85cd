"""A real OTLP/HTTP receiver for tests: decodes the protobuf export requests that the
OpenTelemetry SDK exporters send (no Collector binary is installable here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start: int
    end: int
    attrs: dict[str, Any]
    events: dict[str, int]
    status_code: int


@dataclass
class Receiver:
    spans: list[Span] = field(default_factory=list)
    # name -> data points of the latest export (cumulative temporality: the latest is the total)
    metrics: dict[str, list[Any]] = field(default_factory=dict)

    def by_name(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]


RECEIVER = web.AppKey("receiver", Receiver)


def receiver_app() -> web.Application:
    app = web.Application()
    rec = app[RECEIVER] = Receiver()

    async def traces(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest.FromString(await request.read())
        for rs in msg.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    rec.spans.append(Span(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), kind=s.kind,
                        start=s.start_time_unix_nano, end=s.end_time_unix_nano,
                        attrs={a.key: _value(a.value) for a in s.attributes},
                        events={e.name: e.time_unix_nano for e in s.events},
                        status_code=s.status.code))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def metrics(request: web.Request) -> web.Response:
        msg = ExportMetricsServiceRequest.FromString(await request.read())
        for rm in msg.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    points = getattr(m, m.WhichOneof("data")).data_points
                    rec.metrics[m.name] = list(points)
        return web.Response(body=ExportMetricsServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app.router.add_post("/v1/traces", traces)
    app.router.add_post("/v1/metrics", metrics)
    return app
