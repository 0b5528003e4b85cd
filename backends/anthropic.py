"""Anthropic Messages API (POST /v1/messages), as a client API and as a backend type.

Wire format (wire-and-telemetry.md §2): every event has an `event:` line (the SDK dispatches on
it, so the byte-exact relay keeps it) and a JSON `type`. Usage is always in the stream:
input tokens in `message_start`, cumulative output tokens in each `message_delta`; the stream
ends with `message_stop`, or with an `error` event.
"""
from __future__ import annotations

from typing import Any

import orjson

from backends.timeline import event_seen, json_object, token_seen
from gateway.context import RequestContext
from gateway.sse import SSEEvent

FAMILY = "anthropic"
# The base_url of an anthropic backend includes /v1 (https://api.anthropic.com/v1).
ROUTES = {"/v1/messages": "/messages"}
OPERATIONS = {"/v1/messages": "chat"}

API_VERSION = "2023-06-01"  # what the SDKs send; the API refuses requests without a version
# Sent upstream only when the client did not send its own (a newer version or a beta must win).
DEFAULT_HEADERS = {"anthropic-version": API_VERSION}


def auth_headers(api_key: str) -> dict[str, str]:
    return {"x-api-key": api_key}


def prepare_request(ctx: RequestContext, body: dict[str, Any], backend: Any = None) -> bool:
    return False  # usage is always in the stream: nothing to ask for


# -- errors in the client's format ---------------------------------------------------------------

# `error.type` values of the API (types/shared/error_type.py) by HTTP status.
_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type_for(status: int) -> str:
    return _STATUS_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> bytes:
    """`{"type": "error", "error": {"type", "message"}}` — the shape the SDK reads. The
    gateway's own code has no field there; the message says what happened."""
    return orjson.dumps({"type": "error", "error": {"type": error_type_for(status),
                                                    "message": message}})


def stream_error_event(message: str, code: str, ctx: RequestContext | None = None) -> bytes:
    """`event: error` (§2.4): the SDK raises on it."""
    kind = "timeout_error" if "timeout" in code else "api_error"
    return (b"event: error\ndata: "
            + orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
            + b"\n\n")


# -- reading the stream ----------------------------------------------------------------------------

# content_block_delta types that carry model output, and the field holding it (§2.5).
_DELTA_TEXT = {"text_delta": "text", "thinking_delta": "thinking",
               "input_json_delta": "partial_json"}
# A tool-use block start is a token: its name is model output (mirrors OpenAI tool-call names).
_TOOL_BLOCKS = frozenset({"tool_use", "server_tool_use"})


class StreamObserver:
    """Reads a Messages event stream into the context. First token (§2.5): the first
    non-empty text / thinking / partial_json delta or a tool_use block start; not
    message_start, pings, signature deltas or empty text blocks."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx

    def on_event(self, ev: SSEEvent, t: int) -> bool:
        ctx = self.ctx
        event_seen(ctx, t)
        if ev.event == b"ping":
            return True
        obj = json_object(ev.data)
        if obj is None:
            return True
        kind = obj.get("type")
        token = visible = False
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict):
                field = _DELTA_TEXT.get(delta.get("type"))  # type: ignore[arg-type]
                if field is not None and delta.get(field):
                    token = True
                    visible = field == "text"
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict):
                if block.get("type") in _TOOL_BLOCKS:
                    token = True
                elif block.get("type") == "text" and block.get("text"):
                    token = visible = True
        elif kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                ctx.response_id = message.get("id")
                ctx.response_model = message.get("model")
                _read_usage(ctx, message.get("usage"), output=False)
        elif kind == "message_delta":
            _read_usage(ctx, obj.get("usage"), output=True)
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason"):
                ctx.finish_reasons[:] = [delta["stop_reason"]]
        elif kind == "message_stop":
            ctx.done = True
        elif kind == "error":
            # The stream ends here: Anthropic sends nothing after an error event.
            ctx.done = True
            error = obj.get("error")
            ctx.error_type = str((error.get("type") if isinstance(error, dict) else None)
                                 or "upstream_error")[:64]
        if token:
            token_seen(ctx, t, visible)
        return True


def _read_usage(ctx: RequestContext, usage: Any, *, output: bool) -> None:
    """Input tokens per the GenAI conventions: Anthropic's `input_tokens` excludes cached
    tokens, so cache reads and writes are added. Output tokens are cumulative; message_start's
    placeholder count is not used (a cut stream then falls back to counted tokens)."""
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("input_tokens"), int):
        cached = (usage.get("cache_read_input_tokens"), usage.get("cache_creation_input_tokens"))
        ctx.prompt_tokens = usage["input_tokens"] + sum(n for n in cached if isinstance(n, int))
    if output and isinstance(usage.get("output_tokens"), int):
        ctx.completion_tokens = usage["output_tokens"]
        ctx.usage_source = "upstream"


def observe_response(ctx: RequestContext, body: bytes) -> None:
    """Read a non-streamed Message (id, model, usage, stop reason)."""
    obj = json_object(body)
    if obj is None:
        return
    ctx.response_id = obj.get("id")
    ctx.response_model = obj.get("model")
    _read_usage(ctx, obj.get("usage"), output=True)
    if obj.get("stop_reason"):
        ctx.finish_reasons.append(obj["stop_reason"])
