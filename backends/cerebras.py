"""Cerebras: an OpenAI-compatible API (/v1/chat/completions, /v1/completions;
wire-and-telemetry.md §4), read by backends/openai.py, which parses its `time_info`.

Its extras: the SDK warms its connection with `GET /v1/tcp_warming` whenever a client is
built; the gateway answers that itself (LOCAL_ROUTES), since a warm connection to the gateway
is all the client can get from it. Streams carry usage and `time_info` unasked, so the gateway
neither asks for usage nor strips anything (the SDK breaks on chunks that lost fields such as
`system_fingerprint`). Upstream base_url: https://api.cerebras.ai/v1.
"""
from __future__ import annotations

from aiohttp import web

from backends.openai import auth_headers  # Bearer, like OpenAI

__all__ = ["FAMILY", "LOCAL_ROUTES", "USAGE_IN_EVERY_STREAM", "auth_headers", "tcp_warming"]

FAMILY = "openai"
USAGE_IN_EVERY_STREAM = True


async def tcp_warming(request: web.Request) -> web.Response:
    """The SDK only wants the connection open (it reads the body as a string and ignores it)."""
    return web.Response(text="")


# path -> (method, handler): requests the gateway answers without an upstream
LOCAL_ROUTES = {"/v1/tcp_warming": ("GET", tcp_warming)}
