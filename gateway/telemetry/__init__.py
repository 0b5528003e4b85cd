"""Telemetry produced once per request from the finished context: Prometheus metrics,
OpenTelemetry spans and OTLP metrics."""
