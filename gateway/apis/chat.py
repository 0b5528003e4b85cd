"""OpenAI Chat Completions and Completions (/v1/chat/completions, /v1/completions): the API of
vLLM, SGLang, Ollama, llama.cpp's server, OpenAI itself, Groq and Cerebras.

What a token is, where usage and errors are (wire-and-telemetry.md §1.5-§1.8, §3, §4, §5.1),
what the request must look like upstream (usage injection, field renames), and how to write an
error in this format. Provider timings (Groq, Cerebras, vLLM) are read by their flavour modules.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from gateway.apis.base import (
    DONE,
    NOTHING,
    TOKEN,
    VISIBLE_TOKEN,
    Api,
    EventInfo,
    Prepared,
    Provider,
    Splice,
    TimingReader,
    TokenShape,
    bounded,
    cache_details,
    json_object,
)

if TYPE_CHECKING:
    from gateway.apis.sse import SSEEvent
    from gateway.config import BackendConfig

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_CHOICES = 128  # OpenAI's own bound on `n`
_CONTENT = b'"delta":{"content":"'  # the text of the common chunk, in compact JSON

# `error.type` by HTTP status, as OpenAI answers.
_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
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
        "type": _STATUS_TYPES.get(status, "server_error" if status >= 500
                                  else "invalid_request_error"),
        "param": param,
        "code": code,
    }})


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


def usage_of(usage: Any) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of an OpenAI-style usage object."""
    if not isinstance(usage, dict):
        return None, None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt if isinstance(prompt, int) else None,
            completion if isinstance(completion, int) else None)


def _error_type(err: Any) -> str:
    if isinstance(err, dict):
        for key in ("type", "code"):
            value = err.get(key)
            if value not in (None, ""):
                return bounded(value)
    return "upstream_error"


# Every provider's timing reader (gateway/apis/__init__.py fills it from the provider table):
# a generic OpenAI-compatible backend may be any of them, and its chunks say which.
TIMINGS: list[TimingReader] = []
# The top-level keys they read (Provider.timing_keys): a chunk with none of them (the role
# chunk, a finish chunk without usage) is given to none.
TIMING_KEYS: frozenset[str] = frozenset()


def _facts(obj: dict[str, Any], *, token: bool = False, visible: bool = False,
           usage_only: bool = False, finish: tuple[str, ...] = ()) -> EventInfo:
    """Usage (with the prompt-cache split), ids and provider timings of a chunk or a whole
    response."""
    usage = obj.get("usage")
    prompt, completion = usage_of(usage)
    timing = None
    for read in TIMINGS if not TIMING_KEYS.isdisjoint(obj) else ():
        found = read(obj)  # a few chunks per stream come here: the first, the last, usage
        if found is not None:
            timing, table = found
            if completion is None and table is not None:  # Groq's streamed usage: x_groq.usage
                prompt, completion = usage_of(table)
                usage = table
            break
    # OpenAI, vLLM (--enable-prompt-tokens-details), Groq and Cerebras:
    # usage.prompt_tokens_details.cached_tokens (a part of prompt_tokens). Groq's non-streamed
    # x_groq.usage holds hardware cache statistics (dram/sram), which are not prompt caching.
    cached, written = cache_details(usage.get("prompt_tokens_details")
                                    if isinstance(usage, dict) else None)
    rid = obj.get("id")
    return EventInfo(token=token, visible=visible, usage_only=usage_only,
                     prompt_tokens=prompt, completion_tokens=completion,
                     cached_tokens=cached, cache_write_tokens=written,
                     response_id=str(rid) if rid is not None else None,
                     response_model=str(obj["model"]) if obj.get("model") is not None else None,
                     finish_reasons=finish, timing=timing)


class ChatCompletions(Api):
    family = "openai"
    routes = {CHAT: ("/chat/completions", "chat"),
              COMPLETIONS: ("/completions", "text_completion")}

    def choices(self, body: dict[str, Any]) -> int:
        n = body.get("n")  # the client's: only a small positive integer counts
        return n if type(n) is int and 1 <= n <= MAX_CHOICES else 1

    def prepare(self, body: dict[str, Any], route: str, stream: bool, backend: BackendConfig,
                provider: Provider) -> Prepared:
        """- `max_completion_tokens` becomes `max_tokens` for a backend with
          `rename_max_completion_tokens` (llama.cpp's server ignores the newer name).
        - For streams we ask for usage (`stream_options.include_usage`) when the client did
          not and the backend would not send it anyway, and strip the usage-only chunk this
          causes, so the client sees exactly what it would have seen without the gateway."""
        changed = False
        if backend.rename_max_completion_tokens:
            changed = rename_max_completion_tokens(body)
        if stream and _needs_usage_injection(body, provider):
            opts = body.get("stream_options")
            new_opts = dict(opts) if isinstance(opts, dict) else {}
            new_opts["include_usage"] = True
            body["stream_options"] = new_opts
            return Prepared(changed=True, usage_injected=True)
        return Prepared(changed=changed)

    def observe(self, event: SSEEvent, route: str) -> EventInfo:
        data = event.data
        if data[:6] == b"[DONE]":
            return DONE
        obj = json_object(data)
        if obj is None:
            return NOTHING
        err = obj.get("error")
        if err:
            return EventInfo(error_type=_error_type(err))
        choices = obj.get("choices")
        token = visible = False
        finish: tuple[str, ...] = ()
        if choices:
            chat = route != COMPLETIONS
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                if chat:
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
                    finish += (bounded(reason),)
            if not finish and "usage" not in obj and "x_groq" not in obj:
                # The common chunk: one delta, nothing else to read.
                return VISIBLE_TOKEN if visible else TOKEN if token else _first(obj)
        usage_only = choices == [] and bool(obj.get("usage"))
        return _facts(obj, token=token, visible=visible, usage_only=usage_only, finish=finish)

    def token_shape(self, event: SSEEvent, route: str, info: EventInfo) -> TokenShape | None:
        """`observe` reads string values only for truthiness (content, finish_reason, ...)
        and keys for presence, so an ordinary text token keeps its answer when its text
        changes: the shape is the event around its `delta.content` (compact JSON, the text
        free of escapes)."""
        data = event.data
        if route != CHAT or b"\n" in data or b"\r" in data:  # one data line only
            return None
        i = data.find(_CONTENT)
        if i < 0:
            return None
        start = i + len(_CONTENT)
        end = data.find(b'"', start)
        if end <= start or data.find(b"\\", start, end) >= 0:
            return None
        return TokenShape(data[:start], data[end:], info)

    def observe_response(self, body: bytes) -> EventInfo:
        obj = json_object(body)
        if obj is None:
            return NOTHING
        finish: tuple[str, ...] = ()
        choices = obj.get("choices")
        if isinstance(choices, list):
            finish = tuple(bounded(c["finish_reason"]) for c in choices
                           if isinstance(c, dict) and c.get("finish_reason"))
        return _facts(obj, finish=finish)

    def error_body(self, status: int, message: str, code: str | None = None,
                   param: str | None = None) -> bytes:
        return error_body(status, message, code, param)

    def stream_error_event(self, message: str, code: str, events_seen: int) -> bytes:
        """An in-band error (§1.6): the SDK raises APIError on a data object with a top-level
        `error`."""
        return b"data: " + orjson.dumps({"error": {
            "message": message, "type": "server_error", "param": None, "code": code,
        }}) + b"\n\n"

    def prefix_key(self, body: dict[str, Any], limit: int) -> bytes | None:
        """The first message of a multi-message chat; the start of a long completion prompt."""
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > 1:
            return orjson.dumps(messages[0])[:limit]
        prompt = body.get("prompt")
        if isinstance(prompt, str) and len(prompt) > limit:
            return prompt[:limit].encode()
        return None

    def output_text(self, event: SSEEvent) -> str | None:
        obj = json_object(event.data)
        choices = obj.get("choices") if obj else None
        if not isinstance(choices, list):
            return None
        parts = []
        for choice in choices:
            if isinstance(choice, dict):
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if isinstance(text, str):
                    parts.append(text)
        return "".join(parts) or None


class ContinuableChat(ChatCompletions):
    """Chat and completions with mid-stream continuation: the text so far goes back as the
    assistant message to continue (vLLM and SGLang's `continue_final_message` with
    `add_generation_prompt: false`), or appended to a completion's prompt."""

    continues = True

    def continuation_text(self, event: SSEEvent) -> tuple[str, str | None] | None:
        obj = json_object(event.data)
        choices = obj.get("choices") if obj else None
        if not isinstance(choices, list) or len(choices) > 1:
            return None
        text = ""
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return None
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("tool_calls") or delta.get("reasoning") \
                        or delta.get("reasoning_content") or delta.get("function_call"):
                    return None  # a prefill of content cannot carry these on
                part = delta.get("content")
            else:
                part = choice.get("text")
            if isinstance(part, str):
                text += part
        rid = obj.get("id") if obj else None
        return text, str(rid) if rid is not None else None

    def continuation_body(self, body: dict[str, Any], route: str, text: str,
                          tokens: int) -> dict[str, Any] | None:
        if self.choices(body) != 1:
            return None
        out = dict(body)
        if route == CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            out["messages"] = [*messages, {"role": "assistant", "content": text}]
            out["continue_final_message"] = True
            out["add_generation_prompt"] = False
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None
            out["prompt"] = prompt + text
        for key in ("max_completion_tokens", "max_tokens"):
            limit = out.get(key)
            if type(limit) is int:
                out[key] = max(1, limit - tokens)
        return out

    def splice_event(self, event: SSEEvent, splice: Splice) -> bytes | None:
        if event.data == b"[DONE]":
            return b"data: [DONE]\n\n"
        obj = json_object(event.data)
        if obj is None:
            return b"data: " + event.data + b"\n\n"
        choices = obj.get("choices")
        usage = obj.get("usage")
        if isinstance(choices, list) and choices:
            kept = []
            for choice in choices:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict):
                    delta.pop("role", None)  # the answer was opened once, by the first attempt
                    if (not delta or delta == {"content": ""}) \
                            and choice.get("finish_reason") is None:
                        continue
                kept.append(choice)
            if not kept and not usage:
                return None
            obj["choices"] = kept
        if splice.response_id is not None:
            obj["id"] = splice.response_id
        if splice.model is not None:
            obj["model"] = splice.model
        if isinstance(usage, dict):
            _count_as_received(usage, splice.tokens_before)
        return b"data: " + orjson.dumps(obj) + b"\n\n"


def _count_as_received(usage: dict[str, Any], tokens_before: int) -> None:
    """A continuation's usage as the client's answer: the text it was given back is not
    prompt but the first part of the completion."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is int and type(completion) is int:
        usage["prompt_tokens"] = max(0, prompt - tokens_before)
        usage["completion_tokens"] = completion + tokens_before


def _first(obj: dict[str, Any]) -> EventInfo:
    """A chunk without output (the role chunk): it still names the response."""
    if obj.get("id") is None:
        return NOTHING
    return _facts(obj)


def _needs_usage_injection(body: dict[str, Any], provider: Provider) -> bool:
    opts = body.get("stream_options")
    asked = opts.get("include_usage") if isinstance(opts, dict) else None
    if asked is True:
        return False
    # Groq (x_groq.usage) and Cerebras put usage in every stream unasked: asking would change
    # nothing, and stripping what they send unasked would drop fields.
    if provider.usage_in_every_stream:
        return False
    return not (asked is None and isinstance(opts, dict)
                and provider.usage_when_stream_options)


API = ContinuableChat()
PROVIDER = Provider(name="openai", family="openai")
