"""The access log: one JSON line per request, written once from the finished record (stage
durations and outcome, never content or keys)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from gateway.telemetry import durations
from gateway.telemetry.attribution import TTFTSplit, cache_bucket, prompt_bucket

if TYPE_CHECKING:
    from gateway.exchange import Exchange

log = logging.getLogger("slogate.access")


def write(ex: Exchange, split: TTFTSplit | None) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(orjson.dumps(record(ex, split)).decode())


def log_ms(ex: Exchange) -> dict[str, float]:
    """Every duration that applies (gateway/telemetry/durations.py), in ms, plus TPOT, the
    provider-reported stages and the gateway's overhead."""
    out = durations.durations_ms(ex)
    tpot = durations.tpot_s(ex)
    if tpot is not None:
        out["tpot"] = round(tpot * 1e3, 3)
    for name, value in (("provider_queue", ex.provider_queue_s),
                        ("provider_prefill", ex.provider_prefill_s),
                        ("provider_decode", ex.provider_decode_s)):
        if value is not None:
            out[name] = round(value * 1e3, 3)
    if ex.overhead_ns or ex.t_sent:
        out["overhead"] = round(durations.overhead_s(ex) * 1e3, 3)
    return out


def record(ex: Exchange, split: TTFTSplit | None) -> dict[str, Any]:
    """The access log's line for a finished request."""
    rec: dict[str, Any] = {
        "request_id": ex.request_id,
        "route": ex.route,
        "model": ex.model,
        "backend": ex.backend,
        "stream": ex.stream,
        "status": ex.status,
        "outcome": ex.outcome,
    }
    if ex.tenant:
        rec["tenant"] = ex.tenant
    if ex.served_model:
        rec["served_model"] = ex.served_model
    if ex.upstream_model and ex.upstream_model != (ex.served_model or ex.model):
        rec["upstream_model"] = ex.upstream_model
    if ex.attempts:
        rec["attempts"] = [{"backend": a.backend, "result": a.result,
                            "ms": round((a.t_end - a.t_sent) / 1e6, 3)} for a in ex.attempts]
    if ex.error_type:
        rec["error_type"] = ex.error_type
    if ex.cancel_phase:
        rec["cancel_phase"] = ex.cancel_phase
    if ex.interruption:
        rec["interruption"] = ex.interruption
    if ex.slo is not None:
        rec["slo_class"] = ex.slo.name
    if ex.verdict:
        rec["verdict"] = ex.verdict
    if ex.trace is not None:
        rec["trace_id"] = ex.trace.trace_id
    rec["ms"] = log_ms(ex)
    rec["events"] = ex.events
    rec["token_events"] = ex.token_events
    if split is not None:
        rec["ttft_stages_ms"] = split.ms()
        rec["ttft_largest_stage"] = split.largest
        if split.missed:
            rec["ttft_miss_stage"] = split.largest
    rec["prompt_tokens"] = ex.prompt_tokens
    rec["completion_tokens"] = ex.completion_tokens
    rec["usage_source"] = ex.usage_source
    if ex.cached_tokens is not None:
        rec["cached_tokens"] = ex.cached_tokens
    if ex.cache_write_tokens is not None:
        rec["cache_write_tokens"] = ex.cache_write_tokens
    if ex.prompt_tokens is not None:
        rec["prefix_cache"] = cache_bucket(ex)
        rec["prompt_length"] = prompt_bucket(ex)
    if ex.finish_reasons:
        rec["finish_reasons"] = ex.finish_reasons
    return rec
