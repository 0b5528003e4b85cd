"""The OpenAI Responses API (POST /v1/responses): served by the same backends as
backends/openai.py (OpenAI, vLLM, SGLang), but a different wire format (wire-and-telemetry.md
§1.9): every event has an `event:` line and a JSON `type`, a `sequence_number`, and the stream
ends with a terminal `response.completed` / `response.incomplete` / `response.failed` (no
`[DONE]`). Usage is always in the terminal event, so nothing is injected.
"""
from __future__ import annotations

from typing import Any

import orjson

from backends.openai import auth_headers, error_body  # same family: same auth, same errors
from backends.timeline import event_seen, json_object, token_seen
from gateway.context import RequestContext
from gateway.sse import SSEEvent

__all__ = ["FAMILY", "ROUTES", "OPERATIONS", "auth_headers", "error_body", "prepare_request",
           "stream_error_event", "StreamObserver", "observe_response"]

FAMILY = "openai"
ROUTES = {"/v1/responses": "/responses"}
OPERATIONS = {"/v1/responses": "chat"}

# Delta events that carry model output (§1.9); the value says whether it is visible text.
_TOKEN_DELTAS = {
    "response.output_text.delta": True,
    "response.refusal.delta": False,
    "response.reasoning_text.delta": False,
    "response.reasoning_summary_text.delta": False,
    "response.function_call_arguments.delta": False,
    "response.custom_tool_call_input.delta": False,
}
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def prepare_request(ctx: RequestContext, body: dict[str, Any], backend: Any = None) -> bool:
    return False  # usage always arrives in the terminal event


def stream_error_event(message: str, code: str, ctx: RequestContext | None = None) -> bytes:
    """The Responses `error` event (`ResponseErrorEvent`). Its sequence_number continues the
    upstream's numbering, which counts events from 0, when the context is known."""
    event: dict[str, Any] = {"type": "error", "code": code, "message": message, "param": None}
    if ctx is not None:
        event["sequence_number"] = ctx.events
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


class StreamObserver:
    """Reads a Responses event stream into the context."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx

    def on_event(self, ev: SSEEvent, t: int) -> bool:
        ctx = self.ctx
        event_seen(ctx, t)
        obj = json_object(ev.data)
        if obj is None:
            return True
        kind = obj.get("type")
        visible = _TOKEN_DELTAS.get(kind)  # type: ignore[arg-type]
        if visible is not None:
            if obj.get("delta"):
                token_seen(ctx, t, visible)
        elif kind == "response.created":
            _read_response(ctx, obj.get("response"))
        elif kind in _TERMINAL:
            ctx.done = True
            _read_response(ctx, obj.get("response"))
        elif kind == "error":
            # An error ends the stream: there is nothing after it to wait for.
            ctx.done = True
            ctx.error_type = str(obj.get("code") or "upstream_error")[:64]
        return True


def _read_response(ctx: RequestContext, response: Any) -> None:
    """id, model, usage, outcome of a Response object (streamed lifecycle event or whole)."""
    if not isinstance(response, dict):
        return
    if ctx.response_id is None:
        ctx.response_id = response.get("id")
        ctx.response_model = response.get("model")
    usage = response.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("input_tokens"), int):
            ctx.prompt_tokens = usage["input_tokens"]
        if isinstance(usage.get("output_tokens"), int):
            ctx.completion_tokens = usage["output_tokens"]
            ctx.usage_source = "upstream"
    status = response.get("status")
    if status == "failed":
        error = response.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        ctx.error_type = ctx.error_type or str(code or "response_failed")[:64]
    elif status in ("completed", "incomplete"):
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        ctx.finish_reasons.append(reason or status)


def observe_response(ctx: RequestContext, body: bytes) -> None:
    """Read a non-streamed Response."""
    _read_response(ctx, json_object(body))
