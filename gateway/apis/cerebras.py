"""Cerebras: an OpenAI-compatible API (/v1/chat/completions, /v1/completions;
wire-and-telemetry.md §4), read by gateway/apis/chat.py; its `time_info` is read here.

Its extras: the SDK warms its connection with `GET /v1/tcp_warming` whenever a client is built;
the gateway answers that itself, since a warm connection to the gateway is all the client can
get from it. Streams carry usage and `time_info` unasked, so the gateway neither asks for usage
nor strips anything (the SDK breaks on chunks that lost fields such as `system_fingerprint`).
Upstream base_url: https://api.cerebras.ai/v1.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.apis.base import Provider, ProviderTiming
from gateway.apis.groq import timing_of


def timing(obj: dict[str, Any]) -> tuple[ProviderTiming, Any] | None:
    """`time_info`: queue_time / prompt_time / completion_time, like Groq's."""
    found = timing_of(obj.get("time_info"))
    return (found, obj.get("usage")) if found is not None else None


async def tcp_warming(request: web.Request) -> web.StreamResponse:
    """The SDK only wants the connection open (it reads the body as a string and ignores it)."""
    return web.Response(text="")


PROVIDER = Provider(name="cerebras", family="openai", usage_in_every_stream=True, timing=timing,
                    timing_keys=("time_info",),
                    local_routes={"/v1/tcp_warming": ("GET", tcp_warming)})
