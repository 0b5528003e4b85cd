"""OpenAI Responses wire format (wire-and-telemetry.md §1.9): the stream renderer and the whole
response.

A stream: `response.created` and `response.in_progress` at once, then one output item per
part of the answer (a `reasoning` item with `response.reasoning_text.delta`s, then a `message`
with `response.output_text.delta`s or a `function_call` with
`response.function_call_arguments.delta`s), each opened with `response.output_item.added` and
closed with its `.done` events, and the terminal `response.completed` (or
`response.incomplete` when the output limit cut it) carrying usage. Every event has an `event:`
line and a `sequence_number` counting from 0.
"""
from __future__ import annotations

from typing import Any

import orjson

from .formats import (
    ARGS_CLOSE,
    ARGS_OPEN,
    WORDS_ARG_JSON,
    WORDS_JSON,
    Output,
    detokenize,
    tool_arguments,
)


def _suffix(rid: str) -> str:
    return rid.removeprefix("resp_")


def _item(kind: str, rid: str, out: Output, text: str, done: bool) -> dict[str, Any]:
    """An output item, in progress (empty) or done (with its text)."""
    status = "completed" if done else "in_progress"
    content: list[dict[str, Any]]
    if kind == "reasoning":
        content = [{"type": "reasoning_text", "text": text}] if done else []
        return {"id": "rs_" + _suffix(rid), "type": "reasoning", "summary": [], "content": content,
                "status": status}
    if kind == "function_call":
        return {"id": "fc_" + _suffix(rid), "type": "function_call", "status": status,
                "call_id": "call_" + _suffix(rid), "name": out.tool,
                "arguments": tool_arguments(text) if done else ""}
    content = ([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
               if done else [])
    return {"id": "msg_" + _suffix(rid), "type": "message", "status": status, "role": "assistant",
            "content": content}


def _kinds(out: Output, n: int) -> list[str]:
    """The output items an answer of n tokens has."""
    kinds = ["reasoning"] if min(out.reasoning, n) else []
    if n > out.reasoning:
        kinds.append("message" if out.tool is None else "function_call")
    return kinds


def response_obj(rid: str, created: int, model: str, out: Output, seq: Any | None,
                 status: str) -> dict[str, Any]:
    """The Response object; with `seq` (finished) its output items and usage."""
    output: list[dict[str, Any]] = []
    usage = None
    incomplete = None
    if seq is not None:
        reasoning, body = out.parts(seq)
        output = [_item(k, rid, out, reasoning if k == "reasoning" else body, True)
                  for k in _kinds(out, seq.generated)]
        usage = {"input_tokens": seq.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": seq.cached_tokens},
                 "output_tokens": seq.generated,
                 "output_tokens_details": {"reasoning_tokens": min(out.reasoning, seq.generated)},
                 "total_tokens": seq.prompt_tokens + seq.generated}
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "model": model, "output": output, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": None, "metadata": {},
            "parallel_tool_calls": True, "temperature": None, "top_p": None,
            "tool_choice": "auto",
            "tools": [] if out.tool is None else [{"type": "function", "name": out.tool,
                                                  "parameters": None, "strict": None}]}


class ResponsesStream:
    __slots__ = ("rid", "created", "model", "out", "seq", "sn", "n", "index", "kind", "start",
                 "pre", "mid", "suf", "words")

    def __init__(self, rid: str, created: int, model: str, out: Output, seq: Any) -> None:
        self.rid = rid
        self.created = created
        self.model = model
        self.out = out
        self.seq = seq
        self.sn = 0  # next sequence_number
        self.n = 0  # tokens so far
        self.index = -1  # output_index of the open item
        self.kind = ""  # its type
        self.start = 0  # its first token
        self.pre = self.mid = self.suf = b""
        self.words = WORDS_JSON

    ping = b": keep-alive\n\n"

    def event(self, kind: str, fields: dict[str, Any]) -> bytes:
        sn = self.sn
        self.sn = sn + 1
        return (b"event: " + kind.encode() + b"\ndata: "
                + orjson.dumps({"type": kind, "sequence_number": sn, **fields}) + b"\n\n")

    def _response(self, status: str, seq: Any | None = None) -> dict[str, Any]:
        return response_obj(self.rid, self.created, self.model, self.out, seq, status)

    def opening(self, role_first: bool) -> bytes:
        return (self.event("response.created", {"response": self._response("in_progress")})
                + self.event("response.in_progress", {"response": self._response("in_progress")}))

    def first(self, tid: int, role_sent: bool) -> bytes:
        return self.token(tid)

    def token(self, tid: int) -> bytes:
        i = self.n
        self.n = i + 1
        if i and i != self.out.reasoning:
            sn = self.sn
            self.sn = sn + 1
            return self.pre + b"%d" % sn + self.mid + self.words[tid] + self.suf
        lead = self._next_item(i)
        sn = self.sn
        self.sn = sn + 1
        # a function call's first delta also carries the arguments' opening fragment
        opening = ARGS_OPEN if self.kind == "function_call" else b""
        return lead + self.pre + b"%d" % sn + self.mid + opening + self.words[tid] + self.suf

    def _ids(self) -> dict[str, Any]:
        return {"item_id": _item(self.kind, self.rid, self.out, "", False)["id"],
                "output_index": self.index}

    def _next_item(self, i: int) -> bytes:
        """Close the open item, open the one token `i` belongs to, and set the delta template."""
        out = self._close_item()
        self.index += 1
        self.start = i
        self.kind = ("reasoning" if i < self.out.reasoning
                     else "message" if self.out.tool is None else "function_call")
        out += self.event("response.output_item.added", {
            "output_index": self.index, "item": _item(self.kind, self.rid, self.out, "", False)})
        ids = self._ids()
        if self.kind == "message":
            out += self.event("response.content_part.added", {
                **ids, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        delta = {"reasoning": "response.reasoning_text.delta",
                 "message": "response.output_text.delta",
                 "function_call": "response.function_call_arguments.delta"}[self.kind]
        self.pre = (b"event: " + delta.encode() + b'\ndata: {"type":"' + delta.encode()
                    + b'","sequence_number":')
        where = (b',"item_id":"' + ids["item_id"].encode() + b'","output_index":'
                 + str(self.index).encode())
        if self.kind == "function_call":
            self.mid, self.suf, self.words = where + b',"delta":"', b'"}\n\n', WORDS_ARG_JSON
        else:
            self.mid = where + b',"content_index":0,"delta":"'
            self.suf = b'","logprobs":[]}\n\n' if self.kind == "message" else b'"}\n\n'
            self.words = WORDS_JSON
        return out

    def _close_item(self) -> bytes:
        if self.index < 0:
            return b""
        seq = self.seq
        end = seq.generated if self.kind != "reasoning" else min(self.out.reasoning, seq.generated)
        text = detokenize(seq.tokens, end, self.start)
        ids = self._ids()
        out = b""
        if self.kind == "reasoning":
            out += self.event("response.reasoning_text.done",
                              {**ids, "content_index": 0, "text": text})
        elif self.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out += self.event("response.output_text.done", {**ids, "content_index": 0,
                                                            "text": text, "logprobs": []})
            out += self.event("response.content_part.done",
                              {**ids, "content_index": 0, "part": part})
        else:
            sn = self.sn
            self.sn = sn + 1
            out += self.pre + b"%d" % sn + self.mid + ARGS_CLOSE + self.suf
            out += self.event("response.function_call_arguments.done",
                              {**ids, "arguments": tool_arguments(text)})
        return out + self.event("response.output_item.done", {
            "output_index": self.index, "item": _item(self.kind, self.rid, self.out, text, True)})

    def finish(self, seq: Any, include_usage: bool) -> bytes:
        status = "incomplete" if seq.finish_reason == "length" else "completed"
        closing = self._close_item()
        if not self.out.terminator:
            return closing
        return closing + self.event("response." + status, {"response": self._response(status, seq)})

    def error(self, message: str, status: int) -> bytes:
        """An `error` event, then the terminal `response.failed`."""
        failed = self._response("failed")
        failed["error"] = {"code": "server_error", "message": message}
        error = self.event("error", {"code": "server_error", "message": message, "param": None})
        if not self.out.terminator:
            return error
        return error + self.event("response.failed", {"response": failed})


def response_body(rid: str, created: int, model: str, seq: Any, out: Output) -> bytes:
    status = "incomplete" if seq.finish_reason == "length" else "completed"
    return orjson.dumps(response_obj(rid, created, model, out, seq, status))
