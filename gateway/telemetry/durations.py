"""Every duration of a request, declared once: its name, the timeline stamp it starts at, the
stamp it ends at, and when it applies. Prometheus, the spans, the OTLP metrics and the access
log all read these declarations (README "Durations" has the table), so one name means one
measurement everywhere.

Stamps are the `Exchange`'s monotonic-ns fields (0 = did not happen); the upstream ones
(t_sent … t_last_token) belong to the attempt that answered. A duration applies only when both
of its stamps exist and its condition holds: a non-streamed answer, for instance, has no
first token and so no TTFT — it is measured by `e2e` alone.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.exchange import Exchange


def _always(ex: Exchange) -> bool:
    return True


def _streamed(ex: Exchange) -> bool:
    return ex.stream


def _retried(ex: Exchange) -> bool:
    return bool(ex.attempts)


@dataclass(frozen=True, slots=True)
class Duration:
    name: str  # the access log's `ms` key; the metric and span names say it too
    start: str  # Exchange stamp it starts at
    end: str  # Exchange stamp it ends at
    when: str  # when it is recorded (README)
    where: str  # where it appears (README)
    applies: Callable[[Exchange], bool] = _always

    def ns(self, ex: Exchange) -> int | None:
        a: int = getattr(ex, self.start)
        b: int = getattr(ex, self.end)
        if a and b and b >= a and (self.applies is _always or self.applies(ex)):
            return b - a
        return None

    def seconds(self, ex: Exchange) -> float | None:
        # `ns` written out again: a finished request reads a dozen durations
        a: int = getattr(ex, self.start)
        b: int = getattr(ex, self.end)
        if a and b and b >= a and (self.applies is _always or self.applies(ex)):
            return (b - a) / 1e9
        return None


BODY = Duration("body", "t_received", "t_body", "the request body was read",
                "log")
GATEWAY_QUEUE = Duration(
    "gateway_queue", "t_received", "t_dispatched",
    "the request was sent upstream (ends at the first attempt's send: body, admission wait, "
    "routing; later attempts are `retries`)",
    "`slogate_gateway_queue_seconds`, span `gateway.queue`, log")
ADMISSION_WAIT = Duration(
    "admission_wait", "t_queued", "t_admitted",
    "the request waited in the admission queue (until admitted, refused or gone); part of "
    "`gateway_queue`",
    "`slogate_admission_queue_wait_seconds`, span `gateway.admission_wait`, log")
RETRIES = Duration(
    "retries", "t_dispatched", "t_sent",
    "an attempt failed before the one that answered (failed attempts and backoff), or the "
    "wait before a first-token race's winning hedge",
    "log, TTFT stage `retries`", _retried)
UPSTREAM_CONNECT = Duration(
    "upstream_connect", "t_connect_start", "t_connect_end",
    "the answering attempt opened a new connection (a pooled one opens none)",
    "`slogate_upstream_connect_seconds`, span `upstream.connect`, log")
UPSTREAM_HEADERS = Duration(
    "upstream_headers", "t_sent", "t_headers",
    "the answering attempt got response headers (its connect included)",
    "`slogate_upstream_headers_seconds`, span `upstream.headers`, log")
FIRST_CHUNK = Duration(
    "first_event", "t_received", "t_first_event",
    "streamed answers, at their first SSE event of any kind",
    "OTLP `gen_ai.client.operation.time_to_first_chunk`, span attribute "
    "`gen_ai.response.time_to_first_chunk`, log", _streamed)
TTFT = Duration(
    "ttft", "t_received", "t_first_token",
    "streamed answers that produced a first token (an error answer has none; a non-streamed "
    "answer is measured by `e2e`)",
    "`slogate_time_to_first_token_seconds`, `slogate_time_to_first_token_by_prompt_seconds`, "
    "OTLP `slogate.time_to_first_token`, span attribute `slogate.ttft_ms`, log", _streamed)
UPSTREAM_TTFT = Duration(
    "upstream_ttft", "t_sent", "t_first_token",
    "as `ttft`, from the answering attempt's send",
    "log (admission learns from it)", _streamed)
FIRST_VISIBLE = Duration(
    "first_visible", "t_received", "t_first_visible",
    "streamed answers with user-visible text (after reasoning or a tool call)",
    "span event `first_visible`, log", _streamed)
DECODE = Duration(
    "decode", "t_first_token", "t_last_token",
    "streamed answers with a first token",
    "span `upstream.decode`, log (TPOT = decode ÷ (output tokens − 1))", _streamed)
FINAL_TOKEN = Duration(
    "final_token", "t_received", "t_last_token",
    "streamed answers with a first token",
    "log", _streamed)
E2E = Duration(
    "e2e", "t_received", "t_end",
    "every request (streamed or not, whatever its outcome)",
    "`slogate_request_duration_seconds{stream}`, OTLP `gen_ai.client.operation.duration`, "
    "the SERVER span's extent, log")

DURATIONS: tuple[Duration, ...] = (BODY, ADMISSION_WAIT, GATEWAY_QUEUE, RETRIES, UPSTREAM_CONNECT,
                                   UPSTREAM_HEADERS, FIRST_CHUNK, TTFT, UPSTREAM_TTFT,
                                   FIRST_VISIBLE, DECODE, FINAL_TOKEN, E2E)

# Not a stamp pair, listed for the README table: (name, definition, when, where).
DERIVED: tuple[tuple[str, str, str, str], ...] = (
    ("tpot", "decode ÷ (completion tokens − 1)", "streamed answers with 2+ output tokens",
     "`slogate_time_per_output_token_seconds`, span attribute `slogate.tpot_ms`, log"),
    ("overhead", ("gateway code time: received → first send (less the admission wait) + the "
                  "time spent relaying each read"), "the request was sent upstream",
     "`slogate_gateway_overhead_seconds`, log"),
    ("provider_queue / provider_prefill / provider_decode",
     "what the provider reported (Groq `x_groq.usage`, Cerebras `time_info`, vLLM `metrics`)",
     "the provider reported it",
     "`slogate_provider_*_seconds`, spans `provider.*`, log"),
)


def durations_ms(ex: Exchange) -> dict[str, float]:
    """Every duration that applies, in ms (the access log's `ms`)."""
    out: dict[str, float] = {}
    for d in DURATIONS:
        ns = d.ns(ex)
        if ns is not None:
            out[d.name] = round(ns / 1e6, 3)
    return out


def ttft_s(ex: Exchange) -> float | None:
    """Time to first token: streamed answers that produced one, nothing else."""
    return TTFT.seconds(ex)


def tpot_s(ex: Exchange) -> float | None:
    """Mean time per output token after the first (§1.7): decode time / (tokens - 1)."""
    n = ex.completion_tokens
    decode = DECODE.seconds(ex)
    if decode is None or not (n and n > 1):
        return None
    return decode / (n - 1)


def overhead_s(ex: Exchange) -> float:
    """Gateway code time: ingress to upstream send (less time queued for admission), plus
    relaying every read."""
    sent = ex.t_dispatched or ex.t_sent
    before = (sent - ex.t_received) if sent else 0
    if ex.t_admitted and ex.admission and ex.admission[1] == "after_queue":
        before = (sent - ex.t_admitted) if sent else 0
    return (before + ex.overhead_ns) / 1e9
