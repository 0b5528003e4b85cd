"""Groq: an OpenAI-compatible API (wire-and-telemetry.md §3), read by gateway/apis/chat.py.

Its extras: the groq SDK puts the API under /openai/v1 (so the gateway serves those paths too,
exactly like the OpenAI routes they mirror), and every stream ends with `x_groq.usage`, whose
queue_time / prompt_time / completion_time become provider-reported stages.
Upstream base_url: https://api.groq.com/openai/v1.
"""
from __future__ import annotations

from typing import Any

from gateway.apis.base import Provider, ProviderTiming, seconds

TIMING_KEYS = ("queue_time", "prompt_time", "completion_time")
_TIMING_KEYS = frozenset(TIMING_KEYS)


def timing_of(table: Any) -> ProviderTiming | None:
    """queue_time / prompt_time / completion_time (seconds) of a Groq or Cerebras table."""
    if not isinstance(table, dict) or _TIMING_KEYS.isdisjoint(table):
        return None
    return ProviderTiming(queue_s=seconds(table.get("queue_time")),
                          prefill_s=seconds(table.get("prompt_time")),
                          decode_s=seconds(table.get("completion_time")))


def timing(obj: dict[str, Any]) -> tuple[ProviderTiming, Any] | None:
    """Streamed: `x_groq.usage` on the final chunk; non-streamed: the top-level `usage` (there
    `x_groq.usage` is hardware cache statistics). Returns the timing and the table holding it
    (which also has the token counts)."""
    groq = obj.get("x_groq")
    for table in (groq.get("usage") if isinstance(groq, dict) else None, obj.get("usage")):
        found = timing_of(table)
        if found is not None:
            return found, table
    return None


PROVIDER = Provider(name="groq", family="openai", usage_in_every_stream=True, timing=timing,
                    timing_keys=("x_groq", "usage"),
                    mirrored_routes={"/openai/v1/chat/completions": "/v1/chat/completions"})
