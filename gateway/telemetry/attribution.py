"""Why a TTFT was what it was: the TTFT split into stages, the prefix-cache bucket and the
prompt-length bucket of a request. Computed once, in finish, from the finished exchange; every
sink (Prometheus, spans, OTLP, the access log) reads the result.

The TTFT split is a partition: its stages add up to the TTFT exactly. In request order:

  stage                      from → to                                              source
  gateway_queue              received → first upstream send (body, admission, routing)  measured
  retries                    first send → the answering attempt's send (failed
                             attempts, backoff)                                     measured
  upstream_connect           a new upstream connection (0 on a pooled one)          measured
  upstream_headers           send → response headers, less the connect              measured
  engine_queue               the engine's queue time                                provider
  prefill                    the engine's prefill time                      provider / inferred
  first_token_after_headers  headers → first token, less what the engine reported   measured

The provider's queue and prefill (Groq `x_groq.usage`, Cerebras `time_info`, vLLM `metrics`)
happen between the send and the first token; they are anchored at the first token (the prefill
ends where the gateway saw the first token, the queue ends where the prefill starts) and carved
out of the time after the headers first, then out of the headers wait. A stage reduced by that
carving becomes `inferred` (it is a remainder); vLLM's prefill is `inferred` too (its TTFT
minus its queue time). Where the provider reports nothing, engine_queue and prefill do not
appear: the engine's time stays in upstream_headers / first_token_after_headers, measured, and
is not split further.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.telemetry.durations import TTFT

if TYPE_CHECKING:
    from gateway.exchange import Exchange

GATEWAY_QUEUE = "gateway_queue"
RETRIES = "retries"
UPSTREAM_CONNECT = "upstream_connect"
UPSTREAM_HEADERS = "upstream_headers"
ENGINE_QUEUE = "engine_queue"
PREFILL = "prefill"
AFTER_HEADERS = "first_token_after_headers"
STAGES = (GATEWAY_QUEUE, RETRIES, UPSTREAM_CONNECT, UPSTREAM_HEADERS, ENGINE_QUEUE, PREFILL,
          AFTER_HEADERS)

MEASURED, PROVIDER, INFERRED = "measured", "provider", "inferred"

# Prefix-cache bucket: the share of the prompt's tokens the provider read from its cache.
HIT, PARTIAL, MISS, UNKNOWN = "hit", "partial", "miss", "unknown"
HIT_SHARE = 0.75  # hit: at least this share of the prompt was cached; partial: some, less
CACHE_BUCKETS = (HIT, PARTIAL, MISS, UNKNOWN)

# Prompt-length bucket (prompt tokens, cached ones included, as the provider counted them).
PROMPT_BOUNDS = (256, 1024, 4096, 16384)
PROMPT_BUCKETS = ("<256", "256-1k", "1k-4k", "4k-16k", "16k+")


@dataclass(slots=True)
class TTFTSplit:
    """One request's TTFT as stages (ns each, adding up to the TTFT), where each number came
    from, the largest stage, and whether the TTFT missed its class's target."""
    ns: dict[str, int]
    sources: dict[str, str]
    largest: str
    missed: bool

    def ms(self) -> dict[str, float]:
        return {k: round(v / 1e6, 3) for k, v in self.ns.items()}

    @property
    def miss_stage(self) -> str | None:
        return self.largest if self.missed else None


def ttft_split(ex: Exchange) -> TTFTSplit | None:
    """The TTFT partition of a streamed answer with a first token; None otherwise."""
    ttft = TTFT.ns(ex)
    if ttft is None or not ex.t_sent or not ex.t_headers or ex.t_first_token < ex.t_headers:
        return None
    dispatched = ex.t_dispatched or ex.t_sent
    ns = {GATEWAY_QUEUE: dispatched - ex.t_received}
    sources = {GATEWAY_QUEUE: MEASURED}
    if ex.attempts:
        ns[RETRIES] = ex.t_sent - dispatched
        sources[RETRIES] = MEASURED
    connect = 0
    if ex.t_connect_start and ex.t_connect_end >= ex.t_connect_start:
        connect = min(ex.t_connect_end - ex.t_connect_start, ex.t_headers - ex.t_sent)
        ns[UPSTREAM_CONNECT] = connect
        sources[UPSTREAM_CONNECT] = MEASURED
    headers = ex.t_headers - ex.t_sent - connect
    after = ex.t_first_token - ex.t_headers
    room = headers + after  # where the engine's own time can lie
    prefill = queue = 0
    if ex.provider_prefill_s is not None:
        prefill = min(int(ex.provider_prefill_s * 1e9), room)
    if ex.provider_queue_s is not None:
        queue = min(int(ex.provider_queue_s * 1e9), room - prefill)
    carved = queue + prefill
    from_after = min(carved, after)
    after -= from_after
    headers -= carved - from_after
    ns[UPSTREAM_HEADERS] = headers
    sources[UPSTREAM_HEADERS] = INFERRED if carved > from_after else MEASURED
    if ex.provider_queue_s is not None:
        ns[ENGINE_QUEUE] = queue
        sources[ENGINE_QUEUE] = PROVIDER
    if ex.provider_prefill_s is not None:
        ns[PREFILL] = prefill
        sources[PREFILL] = INFERRED if ex.provider_prefill_inferred else PROVIDER
    ns[AFTER_HEADERS] = after
    sources[AFTER_HEADERS] = INFERRED if from_after else MEASURED
    largest = max(ns, key=lambda stage: ns[stage])  # first in request order on a tie
    slo = ex.slo
    missed = slo is not None and ttft / 1e6 > slo.ttft_ms
    return TTFTSplit(ns, sources, largest, missed)


def cache_bucket(ex: Exchange) -> str:
    """hit (≥ 75 % of the prompt read from the provider's prefix cache), partial (some),
    miss (none), unknown (the provider reported no cache figure, or no prompt count)."""
    cached, prompt = ex.cached_tokens, ex.prompt_tokens
    if cached is None or not prompt:
        return UNKNOWN
    if cached <= 0:
        return MISS
    return HIT if cached >= HIT_SHARE * prompt else PARTIAL


def prompt_bucket(ex: Exchange) -> str:
    """The prompt-length bucket (tokens), or `unknown` without a count."""
    prompt = ex.prompt_tokens
    if prompt is None:
        return UNKNOWN
    return PROMPT_BUCKETS[bisect_right(PROMPT_BOUNDS, prompt)]
