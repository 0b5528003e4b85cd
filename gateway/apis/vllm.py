"""vLLM: an OpenAI-compatible engine (wire-and-telemetry.md §5), read by gateway/apis/chat.py.

Its extras: its StreamOptions default include_usage to true, so a client's `stream_options: {}`
already brings usage (nothing to inject or strip); with `--enable-per-request-metrics` its
responses carry `metrics` whose queue time and TTFT give the engine's queue and prefill (the
prefill inferred: TTFT minus queue); with `--enable-prompt-tokens-details` its usage carries
`prompt_tokens_details.cached_tokens` (prefix-cache hits), read like OpenAI's.
Backends of type "openai" with `provider = "vllm"` get this flavour too.
"""
from __future__ import annotations

from typing import Any

from gateway.apis.base import Provider, ProviderTiming, seconds


def timing(obj: dict[str, Any]) -> tuple[ProviderTiming, Any] | None:
    """`metrics.queue_time_ms` and `time_to_first_token_ms`, both counted from arrival, so TTFT
    minus queue is its prefill; its generation_time_ms is not clearly decode-only, so it is not
    used."""
    metrics = obj.get("metrics")
    if not isinstance(metrics, dict):
        return None
    queue_ms = seconds(metrics.get("queue_time_ms"))
    if queue_ms is None:
        return None
    ttft_ms = seconds(metrics.get("time_to_first_token_ms"))
    prefill = (ttft_ms - queue_ms) / 1e3 if ttft_ms is not None and ttft_ms >= queue_ms else None
    return ProviderTiming(queue_s=queue_ms / 1e3, prefill_s=prefill,
                          prefill_inferred=prefill is not None), None


PROVIDER = Provider(name="vllm", family="openai", usage_when_stream_options=True, timing=timing,
                    timing_keys=("metrics",))
