"""The access log: one line per request, written once from the finished record (stage
durations and outcome, never content or keys). Two formats, chosen at start-up
(`[server] access_log_format`): `json`, every field, for a log pipeline; `text`, one short
line a person can read in a terminal (time, status, outcome, route, model and backend, TTFT,
E2E, tokens)."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway.edge.ingress import max_output_tokens
from gateway.errors import OK
from gateway.telemetry import durations
from gateway.telemetry.attribution import TTFTSplit, cache_bucket, prompt_bucket
from gateway.timeline import now_ns

if TYPE_CHECKING:
    from gateway.exchange import Exchange

log = logging.getLogger("slogate.access")

FORMATS = ("json", "text")
# The text line's client- or config-chosen fields are clipped so that it stays short: ~90
# characters for a usual request, ~135 for a long model name on the longest route, 160 at most.
_MODEL_CHARS, _BACKEND_CHARS, _REASON_CHARS = 24, 12, 22
_text = False  # the format in use (use()), one per process like the logger itself


def use(fmt: str) -> None:
    """Write the access log in `fmt` (one of FORMATS) from now on."""
    global _text
    _text = fmt == "text"


def write(ex: Exchange, split: TTFTSplit | None) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(text_line(ex) if _text else orjson.dumps(record(ex, split)).decode())


def arrival_wall_s(ex: Exchange, wall_now: float | None = None) -> float:
    """When the request arrived, in Unix seconds (`wall_now`: the wall clock now)."""
    wall = time.time() if wall_now is None else wall_now
    return wall - (now_ns() - ex.t_received) / 1e9


def sanitised(value: str | None, n: int) -> str:
    """A field of the text line: printable (a client's model name must not reach a terminal
    as control characters), at most n characters."""
    if not value:
        return "-"
    shown = "".join(c if c.isprintable() and not c.isspace() else "?" for c in value)
    return shown if len(shown) <= n else shown[:n - 1] + "…"


def _ms(ms: float) -> str:
    return f"{ms:.0f}ms" if ms < 10_000 else f"{ms / 1e3:.1f}s"


def text_line(ex: Exchange, now: float | None = None) -> str:
    """`14:02:07 200 ok /v1/chat/completions sim-llama-8b@sim ttft=41ms e2e=655ms 21+64 tok`:
    a failure says why instead of `ok` (its error type, else its outcome), a missed SLO says
    which (`slo=ttft_missed`); what is not known is left out."""
    ms = durations.durations_ms(ex)
    if ex.outcome == OK or not ex.error_type or ex.error_type.isdigit():  # digits: the status
        result = ex.outcome or "unknown"
    else:
        result = sanitised(ex.error_type, _REASON_CHARS)
    parts = [time.strftime("%H:%M:%S", time.localtime(now)), str(ex.status or "-"), result,
             ex.route,
             f"{sanitised(ex.model, _MODEL_CHARS)}@{sanitised(ex.backend, _BACKEND_CHARS)}"]
    parts += [f"{name}={_ms(ms[name])}" for name in ("ttft", "e2e") if name in ms]
    if ex.prompt_tokens is not None or ex.completion_tokens is not None:
        parts.append(f"{_count(ex.prompt_tokens)}+{_count(ex.completion_tokens)} tok")
    if ex.verdict and ex.verdict.endswith("_missed"):
        parts.append(f"slo={ex.verdict}")
    return " ".join(parts)


def _count(n: int | None) -> str:
    return "?" if n is None else str(n)


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
    if ex.client_paused_ns:
        out["client_paused"] = round(ex.client_paused_ns / 1e6, 3)
    return out


def record(ex: Exchange, split: TTFTSplit | None) -> dict[str, Any]:
    """The access log's line for a finished request. `t` is its arrival as unix time (what
    `slogate replay` schedules by); `body_bytes` and `max_tokens` let a replay rebuild a
    request that never reached an engine (no usage counted)."""
    rec: dict[str, Any] = {
        "t": round(arrival_wall_s(ex), 6),
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
    if ex.hedge:  # a first-token race: how it ended
        rec["hedge"] = ex.hedge
    if ex.continued_from:  # the stream broke there and another attempt continued it
        rec["continued_from_token"] = list(ex.continued_from)
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
    rec["body_bytes"] = len(ex.body)
    limit = max_output_tokens(ex.parsed)
    if limit is not None:
        rec["max_tokens"] = limit
    if ex.admission is not None:
        rec["admission"] = {"decision": ex.admission[0], "reason": ex.admission[1]}
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
