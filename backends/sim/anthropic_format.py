"""Anthropic Messages wire format (wire-and-telemetry.md §2): the stream renderer, the whole
message and the error bodies.

A stream: `message_start` (input usage) and a `ping` at once, then one content block per part
of the answer (`thinking` with a closing `signature_delta`, then `text` or one `tool_use` whose
input streams as `input_json_delta` fragments), `message_delta` (stop reason, cumulative
usage) and `message_stop`. Every event has an `event:` line naming its type.
"""
from __future__ import annotations

from typing import Any

import orjson

from .formats import ARGS_CLOSE, ARGS_OPEN, WORDS_ARG_JSON, WORDS_JSON, Output, tool_arguments

PING = b'event: ping\ndata: {"type":"ping"}\n\n'
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
SIGNATURE = "c2ltLXNpZ25hdHVyZQ=="  # an opaque thinking-block signature, as the API sends one

# error.type by HTTP status (the SDK picks its exception class from the status)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, status: int) -> bytes:
    return orjson.dumps({"type": "error",
                         "error": {"type": error_type(status), "message": message}})


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def _usage(seq: Any) -> dict[str, Any]:
    """Anthropic's input_tokens exclude cache reads and writes (a miss writes the prefix)."""
    return {"input_tokens": seq.prompt_tokens - seq.cached_tokens - seq.cache_write_tokens,
            "cache_creation_input_tokens": seq.cache_write_tokens,
            "cache_read_input_tokens": seq.cached_tokens}


def stop_reason(seq: Any, out: Output) -> str:
    if seq.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if out.called_tool(seq) else "end_turn"


def tool_id(rid: str) -> str:
    return "toolu_" + rid.removeprefix("msg_")


class AnthropicStream:
    __slots__ = ("rid", "model", "out", "seq", "n", "block", "kind", "pre", "suf", "words")
    ping = PING

    def __init__(self, rid: str, created: int, model: str, out: Output, seq: Any) -> None:
        self.rid = rid
        self.model = model
        self.out = out
        self.seq = seq
        self.n = 0
        self.block = -1  # index of the open content block
        self.kind = ""  # its type
        self.pre = self.suf = b""
        self.words = WORDS_JSON

    def opening(self, role_first: bool) -> bytes:
        message: dict[str, Any] = {
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**_usage(self.seq), "output_tokens": 1}}
        return event("message_start", {"type": "message_start", "message": message}) + PING

    def first(self, tid: int, role_sent: bool) -> bytes:
        return self.token(tid)

    def token(self, tid: int) -> bytes:
        i = self.n
        self.n = i + 1
        if i and i != self.out.reasoning:
            return self.pre + self.words[tid] + self.suf
        return self._next_block(i) + self.words[tid] + self.suf

    def _next_block(self, i: int) -> bytes:
        """Close the open block, open the one token `i` belongs to; returns the events up to
        where the token's text goes."""
        out = self._close_block()
        self.block += 1
        index = self.block
        block: dict[str, Any]
        if i < self.out.reasoning:
            kind, delta = "thinking", "thinking_delta"
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif self.out.tool is None:
            kind, block, delta = "text", {"type": "text", "text": ""}, "text_delta"
        else:
            kind, delta = "tool_use", "input_json_delta"
            block = {"type": "tool_use", "id": tool_id(self.rid), "name": self.out.tool,
                     "input": {}}
        field = {"thinking_delta": "thinking", "text_delta": "text"}.get(delta, "partial_json")
        self.pre = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
                    + str(index).encode() + b',"delta":{"type":"' + delta.encode() + b'","'
                    + field.encode() + b'":"')
        self.suf = b'"}}\n\n'
        self.kind = kind
        self.words = WORDS_ARG_JSON if kind == "tool_use" else WORDS_JSON
        out += event("content_block_start", {"type": "content_block_start", "index": index,
                                             "content_block": block})
        return out + self.pre + (ARGS_OPEN if kind == "tool_use" else b"")

    def _close_block(self) -> bytes:
        if self.block < 0:
            return b""
        index = self.block
        out = b""
        if self.kind == "tool_use":
            out = self.pre + ARGS_CLOSE + self.suf
        elif self.kind == "thinking":
            out = event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "signature_delta",
                                                          "signature": SIGNATURE}})
        return out + event("content_block_stop", {"type": "content_block_stop", "index": index})

    def finish(self, seq: Any, include_usage: bool) -> bytes:
        return (self._close_block()
                + event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": stop_reason(seq, self.out),
                                                    "stop_sequence": None},
                                          "usage": {**_usage(seq), "output_tokens": seq.generated}})
                + (MESSAGE_STOP if self.out.terminator else b""))

    def error(self, message: str, status: int) -> bytes:
        """The API's mid-stream error: the stream ends with it, no message_stop."""
        return event("error", {"type": "error", "error": {"type": error_type(status),
                                                          "message": message}})


def message_body(rid: str, created: int, model: str, seq: Any, out: Output) -> bytes:
    reasoning, text = out.parts(seq)
    content: list[dict[str, Any]] = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": SIGNATURE})
    if out.called_tool(seq):
        content.append({"type": "tool_use", "id": tool_id(rid), "name": out.tool,
                        "input": orjson.loads(tool_arguments(text))})
    elif text:
        content.append({"type": "text", "text": text})
    return orjson.dumps({
        "id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason(seq, out), "stop_sequence": None,
        "usage": {**_usage(seq), "output_tokens": seq.generated},
    })
