"""Groq: an OpenAI-compatible API (wire-and-telemetry.md §3), read by backends/openai.py.

Its extras: the groq SDK puts the API under /openai/v1 (so the gateway serves those paths
too, exactly like the OpenAI routes they mirror), and every stream ends with `x_groq.usage`,
whose queue_time / prompt_time / completion_time become provider-reported stages.
Upstream base_url: https://api.groq.com/openai/v1.
"""
from __future__ import annotations

from backends.openai import auth_headers  # Bearer, like OpenAI

__all__ = ["FAMILY", "CLIENT_ROUTES", "USAGE_IN_EVERY_STREAM", "auth_headers"]

FAMILY = "openai"
# Client route -> the OpenAI route it mirrors (same API module, operation and upstream path).
CLIENT_ROUTES = {"/openai/v1/chat/completions": "/v1/chat/completions"}
# x_groq.usage closes every stream: the gateway need not ask for usage.
USAGE_IN_EVERY_STREAM = True
