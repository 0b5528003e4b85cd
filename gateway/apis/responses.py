"""The OpenAI Responses API (POST /v1/responses): served by the same backends as the chat API
(OpenAI, vLLM, SGLang), but a different wire format (wire-and-telemetry.md §1.9): every event
has an `event:` line and a JSON `type`, a `sequence_number`, and the stream ends with a terminal
`response.completed` / `response.incomplete` / `response.failed` (no `[DONE]`). Usage is always
in the terminal event, so nothing is injected.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from gateway.apis import chat
from gateway.apis.base import (
    NOTHING,
    TOKEN,
    VISIBLE_TOKEN,
    Api,
    EventInfo,
    bounded,
    cache_details,
    json_object,
)

if TYPE_CHECKING:
    from gateway.apis.sse import SSEEvent

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


def _response_facts(response: Any, *, done: bool = False) -> EventInfo:
    """id, model, usage, outcome of a Response object (streamed lifecycle event or whole)."""
    if not isinstance(response, dict):
        return EventInfo(done=done)
    prompt = completion = cached = written = None
    usage = response.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("input_tokens"), int):
            prompt = usage["input_tokens"]
        if isinstance(usage.get("output_tokens"), int):
            completion = usage["output_tokens"]
        # usage.input_tokens_details.cached_tokens (a part of input_tokens)
        cached, written = cache_details(usage.get("input_tokens_details"))
    error_type = None
    finish: tuple[str, ...] = ()
    status = response.get("status")
    if status == "failed":
        error = response.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        error_type = bounded(code or "response_failed")
    elif status in ("completed", "incomplete"):
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        finish = (bounded(reason or status),)
    rid, model = response.get("id"), response.get("model")
    return EventInfo(done=done, error_type=error_type, prompt_tokens=prompt,
                     completion_tokens=completion, cached_tokens=cached,
                     cache_write_tokens=written,
                     response_id=str(rid) if rid is not None else None,
                     response_model=str(model) if model is not None else None,
                     finish_reasons=finish)


class Responses(Api):
    family = "openai"
    routes = {"/v1/responses": ("/responses", "chat")}

    def observe(self, event: SSEEvent, route: str) -> EventInfo:
        obj = json_object(event.data)
        if obj is None:
            return NOTHING
        kind = obj.get("type")
        visible = _TOKEN_DELTAS.get(kind) if isinstance(kind, str) else None
        if visible is not None:
            if not obj.get("delta"):
                return NOTHING
            return VISIBLE_TOKEN if visible else TOKEN
        if kind == "response.created":
            return _response_facts(obj.get("response"))
        if kind in _TERMINAL:
            return _response_facts(obj.get("response"), done=True)
        if kind == "error":
            # An error ends the stream: there is nothing after it to wait for.
            return EventInfo(done=True, error_type=bounded(obj.get("code") or "upstream_error"))
        return NOTHING

    def observe_response(self, body: bytes) -> EventInfo:
        return _response_facts(json_object(body))

    def error_body(self, status: int, message: str, code: str | None = None,
                   param: str | None = None) -> bytes:
        return chat.error_body(status, message, code, param)  # same family, same errors

    def stream_error_event(self, message: str, code: str, events_seen: int) -> bytes:
        """The Responses `error` event (`ResponseErrorEvent`). Its sequence_number continues
        the upstream's numbering, which counts events from 0."""
        event: dict[str, Any] = {"type": "error", "code": code, "message": message,
                                 "param": None, "sequence_number": events_seen}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"

    def prefix_key(self, body: dict[str, Any], limit: int) -> bytes | None:
        """The instructions, or the first input item of a multi-item input."""
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            return instructions.encode()[:limit]
        items = body.get("input")
        if isinstance(items, list) and len(items) > 1:
            return orjson.dumps(items[0])[:limit]
        return None

    def output_text(self, event: SSEEvent) -> str | None:
        obj = json_object(event.data)
        if obj and obj.get("type") == "response.output_text.delta":
            delta = obj.get("delta")
            return delta if isinstance(delta, str) else None
        return None


API = Responses()
