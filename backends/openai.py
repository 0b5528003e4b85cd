"""OpenAI-compatible backends: vLLM, SGLang, Ollama, llama.cpp server, OpenAI itself (and the
OpenAI-compatible APIs of Groq and Cerebras, whose extras are read here too).

Knows this API family's paths, how to authenticate upstream, what the client's request must
look like upstream (usage injection, field renames), how to read its stream (what is a token,
where usage and errors are; wire-and-telemetry.md §1.5-§1.8, §3, §4, §5.1) and how to write an
error in its format. The Responses API is a different wire format: backends/openai_responses.py.
"""
from __future__ import annotations

from typing import Any

import orjson

import backends
from backends.timeline import event_seen, json_object, token_seen
from gateway.context import RequestContext
from gateway.sse import SSEEvent

FAMILY = "openai"  # the API family this module's routes speak; backend types declare theirs

# Client route -> path under the backend's base_url (which includes the /v1 prefix).
# backends/__init__.py adds the routes that mirror these (Groq's /openai/v1/...).
ROUTES = {
    "/v1/chat/completions": "/chat/completions",
    "/v1/completions": "/completions",
}
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}

# Providers whose server sends usage whenever `stream_options` is present, unless
# `include_usage` is false (vLLM's StreamOptions defaults include_usage to true, §5.1).
USAGE_WHEN_STREAM_OPTIONS = frozenset({"vllm"})


def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


def prepare_request(ctx: RequestContext, body: dict[str, Any], backend: Any = None) -> bool:
    """Adjust the parsed body (a shallow copy of the client's) for upstream; True if it changed.

    `backend` is the chosen replica's BackendConfig (None: treat it as OpenAI itself).
    - `max_completion_tokens` becomes `max_tokens` for a backend with
      `rename_max_completion_tokens` (llama.cpp's server ignores the newer name).
    - For streams we ask for usage (`stream_options.include_usage`) when the client did not and
      the backend would not send it anyway, and remember to strip the usage-only chunk this
      causes, so the client sees exactly what it would have seen without the gateway.
    """
    changed = False
    if backend is not None and getattr(backend, "rename_max_completion_tokens", False):
        changed = rename_max_completion_tokens(body)
    if ctx.stream and _needs_usage_injection(body, backend):
        opts = body.get("stream_options")
        new_opts = dict(opts) if isinstance(opts, dict) else {}
        new_opts["include_usage"] = True
        body["stream_options"] = new_opts
        ctx.usage_injected = True
        changed = True
    return changed


def rename_max_completion_tokens(body: dict[str, Any]) -> bool:
    """`max_completion_tokens` -> `max_tokens` (the smaller limit wins if both are set)."""
    if "max_completion_tokens" not in body:
        return False
    limit = body.pop("max_completion_tokens")
    other = body.get("max_tokens")
    if other is None:
        body["max_tokens"] = limit
    elif isinstance(limit, int) and isinstance(other, int):
        body["max_tokens"] = min(limit, other)
    return True


def _needs_usage_injection(body: dict[str, Any], backend: Any) -> bool:
    opts = body.get("stream_options")
    asked = opts.get("include_usage") if isinstance(opts, dict) else None
    if asked is True:
        return False
    if backend is not None:
        # Groq (x_groq.usage) and Cerebras put usage in every stream unasked: asking would
        # change nothing, and stripping what they send unasked would drop fields.
        if getattr(backends.BACKEND_TYPES.get(backend.type), "USAGE_IN_EVERY_STREAM", False):
            return False
        if (asked is None and isinstance(opts, dict)
                and getattr(backend, "provider", "") in USAGE_WHEN_STREAM_OPTIONS):
            return False
    return True


# -- errors in the client's format ---------------------------------------------------------------

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}` — what the OpenAI SDKs read."""
    return orjson.dumps({"error": {
        "message": message,
        "type": _STATUS_TYPES.get(status,
                                  "server_error" if status >= 500 else "invalid_request_error"),
        "param": param,
        "code": code,
    }})


def stream_error_event(message: str, code: str, ctx: RequestContext | None = None) -> bytes:
    """An in-band error for a stream already committed to the client (§1.6): the SDK raises
    APIError on a data object with a top-level `error`."""
    return b"data: " + orjson.dumps({"error": {
        "message": message, "type": "server_error", "param": None, "code": code,
    }}) + b"\n\n"


# -- reading the stream ----------------------------------------------------------------------------

class StreamObserver:
    """Reads events of a chat.completion.chunk or text_completion stream into the context.

    `on_event` returns False for the one event the client must not see: the usage-only chunk
    (`choices: []`) that exists only because the gateway asked for usage.
    """

    __slots__ = ("ctx", "chat")

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.chat = OPERATIONS[ctx.route] == "chat"

    def on_event(self, ev: SSEEvent, t: int) -> bool:
        ctx = self.ctx
        event_seen(ctx, t)
        data = ev.data
        if data[:6] == b"[DONE]":
            ctx.done = True
            return True
        obj = json_object(data)
        if obj is None:
            return True
        err = obj.get("error")
        if err:
            ctx.error_type = _error_type(err)
            return True
        if ctx.response_id is None:
            ctx.response_id = obj.get("id")
            ctx.response_model = obj.get("model")
        usage = obj.get("usage")
        if usage:
            read_usage(ctx, usage)
            read_server_timing(ctx, obj)
        elif "x_groq" in obj or "time_info" in obj:
            read_server_timing(ctx, obj)
        choices = obj.get("choices")
        if not choices:
            return not (usage and ctx.usage_injected and choices == [])
        token = visible = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if self.chat:
                delta = choice.get("delta")
                if isinstance(delta, dict) and delta:
                    if delta.get("content"):
                        token = visible = True
                    elif (delta.get("tool_calls") or delta.get("refusal")
                          or delta.get("reasoning") or delta.get("reasoning_content")
                          or delta.get("function_call")):
                        token = True
            elif choice.get("text"):
                token = visible = True
            reason = choice.get("finish_reason")
            if reason:
                ctx.finish_reasons.append(reason)
        if token:
            token_seen(ctx, t, visible)
        return True


def _error_type(err: Any) -> str:
    if isinstance(err, dict):
        for key in ("type", "code"):
            value = err.get(key)
            if value not in (None, ""):
                return str(value)[:64]
    return "upstream_error"


def read_usage(ctx: RequestContext, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if isinstance(prompt, int):
        ctx.prompt_tokens = prompt
    if isinstance(completion, int):
        ctx.completion_tokens = completion
        ctx.usage_source = "upstream"


def _seconds(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


_TIMING_KEYS = ("queue_time", "prompt_time", "completion_time")


def read_server_timing(ctx: RequestContext, obj: dict[str, Any]) -> None:
    """Stages the provider reported about itself, in seconds (wire-and-telemetry.md §10).

    - Groq: streamed, `x_groq.usage` on the final chunk; non-streamed, the top-level `usage`
      (there `x_groq.usage` is hardware cache statistics). Fields queue_time, prompt_time,
      completion_time.
    - Cerebras: `time_info` with the same names.
    - vLLM (`--enable-per-request-metrics`): `metrics` with queue_time_ms and
      time_to_first_token_ms counted from arrival, so TTFT minus queue is its prefill; its
      generation_time_ms is not clearly decode-only, so it is not used.
    """
    timing = None
    groq = obj.get("x_groq")
    for candidate in (groq.get("usage") if isinstance(groq, dict) else None, obj.get("usage"),
                      obj.get("time_info")):
        if isinstance(candidate, dict) and any(k in candidate for k in _TIMING_KEYS):
            timing = candidate
            break
    if timing is not None:
        if ctx.completion_tokens is None:
            read_usage(ctx, timing)
        ctx.provider_queue_s = _seconds(timing.get("queue_time"))
        ctx.provider_prefill_s = _seconds(timing.get("prompt_time"))
        ctx.provider_decode_s = _seconds(timing.get("completion_time"))
        return
    vllm = obj.get("metrics")
    if isinstance(vllm, dict):
        queue_ms = _seconds(vllm.get("queue_time_ms"))
        ttft_ms = _seconds(vllm.get("time_to_first_token_ms"))
        if queue_ms is not None:
            ctx.provider_queue_s = queue_ms / 1e3
            if ttft_ms is not None and ttft_ms >= queue_ms:
                ctx.provider_prefill_s = (ttft_ms - queue_ms) / 1e3


def observe_response(ctx: RequestContext, body: bytes) -> None:
    """Read a non-streamed response body (id, model, usage, finish reasons)."""
    obj = json_object(body)
    if obj is None:
        return
    ctx.response_id = obj.get("id")
    ctx.response_model = obj.get("model")
    read_usage(ctx, obj.get("usage"))
    read_server_timing(ctx, obj)
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                ctx.finish_reasons.append(choice["finish_reason"])
