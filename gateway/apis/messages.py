"""Anthropic Messages API (POST /v1/messages), as a client API and as a backend flavour.

Wire format (wire-and-telemetry.md §2): every event has an `event:` line (the SDK dispatches on
it, so the byte-exact relay keeps it) and a JSON `type`. Usage is always in the stream: input
tokens in `message_start`, cumulative output tokens in each `message_delta`; the stream ends
with `message_stop`, or with an `error` event.
"""
from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

from gateway.apis.base import (
    DONE,
    NOTHING,
    TOKEN,
    VISIBLE_TOKEN,
    Api,
    EventInfo,
    Provider,
    Splice,
    bounded,
    count,
    json_object,
)

if TYPE_CHECKING:
    from gateway.apis.sse import SSEEvent
    from gateway.errors import RateLimits

API_VERSION = "2023-06-01"  # what the SDKs send; the API refuses requests without a version

# `error.type` values of the API (types/shared/error_type.py) by HTTP status.
_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}

# content_block_delta types that carry model output, and the field holding it (§2.5).
_DELTA_TEXT = {"text_delta": "text", "thinking_delta": "thinking",
               "input_json_delta": "partial_json"}
# A tool-use block start is a token: its name is model output (mirrors OpenAI tool-call names).
_TOOL_BLOCKS = frozenset({"tool_use", "server_tool_use"})


def error_type_for(status: int) -> str:
    return _STATUS_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> bytes:
    """`{"type": "error", "error": {"type", "message"}}` — the shape the SDK reads. The
    gateway's own code has no field there; the message says what happened."""
    return orjson.dumps({"type": "error", "error": {"type": error_type_for(status),
                                                    "message": message}})


def _usage(usage: Any, *, output: bool) -> EventInfo:
    """Input tokens per the GenAI conventions: Anthropic's `input_tokens` excludes cached
    tokens, so cache reads and writes are added (and kept apart as cached / written). Output
    tokens are cumulative; message_start's placeholder count is not used (a cut stream then
    falls back to counted tokens)."""
    if not isinstance(usage, dict):
        return NOTHING
    prompt = completion = None
    read = count(usage.get("cache_read_input_tokens"))
    written = count(usage.get("cache_creation_input_tokens"))
    if isinstance(usage.get("input_tokens"), int):
        prompt = usage["input_tokens"] + (read or 0) + (written or 0)
    if output and isinstance(usage.get("output_tokens"), int):
        completion = usage["output_tokens"]
    return EventInfo(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=read,
                     cache_write_tokens=written)


class Messages(Api):
    """First token (§2.5): the first non-empty text / thinking / partial_json delta or a
    tool_use block start; not message_start, pings, signature deltas or empty text blocks."""

    family = "anthropic"
    # The base_url of an anthropic backend includes /v1 (https://api.anthropic.com/v1).
    routes = {"/v1/messages": ("/messages", "chat")}

    def observe(self, event: SSEEvent, route: str) -> EventInfo:
        if event.event == b"ping":
            return NOTHING
        obj = json_object(event.data)
        if obj is None:
            return NOTHING
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict):
                field = _DELTA_TEXT.get(delta.get("type"))  # type: ignore[arg-type]
                if field is not None and delta.get(field):
                    return VISIBLE_TOKEN if field == "text" else TOKEN
            return NOTHING
        if kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict):
                if block.get("type") in _TOOL_BLOCKS:
                    return TOKEN
                if block.get("type") == "text" and block.get("text"):
                    return VISIBLE_TOKEN
            return NOTHING
        if kind == "message_start":
            message = obj.get("message")
            if not isinstance(message, dict):
                return NOTHING
            u = _usage(message.get("usage"), output=False)
            rid, model = message.get("id"), message.get("model")
            return EventInfo(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                             cache_write_tokens=u.cache_write_tokens,
                             response_id=str(rid) if rid is not None else None,
                             response_model=str(model) if model is not None else None)
        if kind == "message_delta":
            u = _usage(obj.get("usage"), output=True)
            delta = obj.get("delta")
            stop = delta.get("stop_reason") if isinstance(delta, dict) else None
            return EventInfo(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                             cached_tokens=u.cached_tokens,
                             cache_write_tokens=u.cache_write_tokens,
                             finish_reasons=(bounded(stop),) if stop else ())
        if kind == "message_stop":
            return DONE
        if kind == "error":
            # The stream ends here: Anthropic sends nothing after an error event.
            error = obj.get("error")
            return EventInfo(done=True, error_type=bounded(
                (error.get("type") if isinstance(error, dict) else None) or "upstream_error"))
        return NOTHING

    def observe_response(self, body: bytes) -> EventInfo:
        obj = json_object(body)
        if obj is None:
            return NOTHING
        u = _usage(obj.get("usage"), output=True)
        rid, model, stop = obj.get("id"), obj.get("model"), obj.get("stop_reason")
        return EventInfo(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                         cached_tokens=u.cached_tokens, cache_write_tokens=u.cache_write_tokens,
                         response_id=str(rid) if rid is not None else None,
                         response_model=str(model) if model is not None else None,
                         finish_reasons=(bounded(stop),) if stop else ())

    def error_body(self, status: int, message: str, code: str | None = None,
                   param: str | None = None) -> bytes:
        return error_body(status, message, code, param)

    def rate_limit_headers(self, limits: RateLimits) -> dict[str, str]:
        """Anthropic's anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset} (reset as
        an RFC 3339 time), what its SDK and clients read."""
        out: dict[str, str] = {}
        now = time.time()
        for kind, limit, remaining, reset in (
                ("requests", limits.requests_limit, limits.requests_remaining,
                 limits.requests_reset_s),
                ("tokens", limits.tokens_limit, limits.tokens_remaining, limits.tokens_reset_s)):
            if limit:
                at = datetime.fromtimestamp(now + reset, tz=UTC).replace(microsecond=0)
                out[f"anthropic-ratelimit-{kind}-limit"] = str(limit)
                out[f"anthropic-ratelimit-{kind}-remaining"] = str(max(0, remaining))
                out[f"anthropic-ratelimit-{kind}-reset"] = at.isoformat().replace("+00:00", "Z")
        return out

    def stream_error_event(self, message: str, code: str, events_seen: int) -> bytes:
        """`event: error` (§2.4): the SDK raises on it."""
        kind = "timeout_error" if "timeout" in code else "api_error"
        return (b"event: error\ndata: "
                + orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
                + b"\n\n")

    def prefix_key(self, body: dict[str, Any], limit: int) -> bytes | None:
        """The system prompt, else the first message of a multi-message conversation."""
        system = body.get("system")
        if system:
            return (system.encode() if isinstance(system, str) else orjson.dumps(system))[:limit]
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > 1:
            return orjson.dumps(messages[0])[:limit]
        return None

    def output_text(self, event: SSEEvent) -> str | None:
        obj = json_object(event.data)
        if obj and obj.get("type") == "content_block_delta":
            delta = obj.get("delta")
            text = delta.get("text") if isinstance(delta, dict) else None
            return text if isinstance(text, str) else None
        return None

    # -- mid-stream continuation: Anthropic's assistant prefill ------------------------------
    # The answer so far goes back as a final assistant message, which the model continues.
    # Anthropic refuses a prefill that ends in whitespace: that part is left out of it, and
    # dropped from the continuation's first text if it sends it again.
    continues = True

    def continuation_text(self, event: SSEEvent) -> tuple[str, str | None] | None:
        obj = json_object(event.data)
        if obj is None or obj.get("index", 0) != 0:
            return None  # one text block only: a second block (a tool call) cannot go on
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta":
                text = delta.get("text")
                return (text, None) if isinstance(text, str) else None
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict) and block.get("type") == "text":
                text = block.get("text")
                return (text, None) if isinstance(text, str) else None
        return None  # thinking, a tool's input

    def continuation_body(self, body: dict[str, Any], route: str, text: str,
                          tokens: int) -> dict[str, Any] | None:
        messages = body.get("messages")
        prefill = text.rstrip()
        if not isinstance(messages, list) or not messages or not prefill:
            return None
        last = messages[-1]
        if isinstance(last, dict) and last.get("role") == "assistant":
            own = last.get("content")  # the client's own prefill: the answer goes on from it
            if not isinstance(own, str):
                return None
            messages, prefill = messages[:-1], own + prefill
        out = dict(body)
        out["messages"] = [*messages, {"role": "assistant", "content": prefill}]
        limit = out.get("max_tokens")
        if type(limit) is int:
            out["max_tokens"] = max(1, limit - tokens)
        return out

    def continuation_repeat(self, text: str) -> str:
        return text[len(text.rstrip()):]

    def splice_event(self, event: SSEEvent, splice: Splice) -> bytes | None:
        obj = json_object(event.data)
        if obj is None:
            return None  # nothing a client could read
        kind = obj.get("type")
        if kind == "message_start":
            return None  # the client's message is open already
        if kind == "content_block_start" and obj.get("index", 0) == 0:
            block = obj.get("content_block")
            text = block.get("text") if isinstance(block, dict) else None
            if not text:
                return None  # so is its first block
            obj = {"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": text}}
            kind = "content_block_delta"
        if kind == "content_block_delta" and splice.repeat:
            delta = obj.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("text"), str):
                repeat, splice.repeat = splice.repeat, ""
                if delta["text"].startswith(repeat):
                    delta["text"] = delta["text"][len(repeat):]
                if not delta["text"]:
                    return None
        if kind == "message_delta":
            usage = obj.get("usage")
            if isinstance(usage, dict):
                if type(usage.get("output_tokens")) is int:
                    usage["output_tokens"] += splice.tokens_before
                if type(usage.get("input_tokens")) is int:
                    usage["input_tokens"] = max(0, usage["input_tokens"] - splice.tokens_before)
        return b"event: " + str(kind).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


API = Messages()
# Sent upstream only when the client did not send its own (a newer version or a beta must win).
PROVIDER = Provider(name="anthropic", family="anthropic", auth_header="x-api-key",
                    default_headers={"anthropic-version": API_VERSION})
