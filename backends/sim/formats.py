"""Wire renderers: turn the engine's token ids and finished sequences into API bytes.

Each streaming renderer is one object per request with precomputed byte templates, so a token
costs two byte concatenations and no JSON encoding. The engine knows nothing about formats; the
server picks a renderer per route. To add a provider format (Anthropic Messages, Responses API,
Groq `x_groq`, Cerebras `time_info`) write another class with the same methods:

    opening(role_first) -> bytes   events written right after the response headers
    first(tid, role_sent) -> bytes the first token (with the role chunk unless sent already)
    token(tid) -> bytes            every later token
    finish(seq, include_usage) -> bytes   finish chunk, usage, terminator
    error(message, code) -> bytes  a mid-stream error event and terminator
    ping: bytes                    a keep-alive that is not a token

`seq` (engine.Seq) carries prompt/completion counts, cached tokens and the monotonic stamps
t_arrival, t_scheduled, t_prefill_done, t_first, t_last, t_end that the timing fields of the
hosted-API formats need.
"""
from __future__ import annotations

from typing import Any

import orjson

# --- vocabulary: 256 tokens so a random byte picks one ----------------------------------------
_WORDS = """the of and to in is that for it as was with be by on not he this are or his from at
which but have an they you were her she there been one all we their has would more if will can
when who so no out up into them time only some could these two may then first any like now over
such our man also did new most other many before must through back years where much your way well
down should because each just those people how too little state good very make world still own
see men work long get here between both life being under never day same another know while last
might us great old year off come since against go came right used take three small large system
data model token stream latency engine batch queue prefill decode cache gateway request answer
signal river mountain light quiet bright simple clear steady careful gentle rapid city road
house water fire earth air stone tree garden window door table paper book letter story number
question reason idea plan result change point place part group problem fact case level order
course example moment minute hour morning evening night summer winter north south east west
always often never sometimes perhaps almost already enough rather quite usually really
open close begin follow bring build carry check choose explain find give hold keep learn leave
measure move need offer read remember send show start stop think try turn wait watch write""".split()
_PUNCT = [",", ".", ";", ":", "!", "?", "\n", "\n\n", " -", " (", ")", " \"", "\"", "'s"]


def _build_vocab() -> list[str]:
    words = [" " + w for w in dict.fromkeys(_WORDS)]
    vocab = (_PUNCT + words)[:256]
    i = 0
    while len(vocab) < 256:  # pad deterministically if the word list is short
        vocab.append(" " + _WORDS[i % len(_WORDS)] + "s")
        i += 1
    return vocab


WORDS: list[str] = _build_vocab()
# JSON-escaped UTF-8 of each token, without the quotes: spliced into byte templates.
WORDS_JSON: list[bytes] = [orjson.dumps(w)[1:-1] for w in WORDS]
assert len(WORDS) == 256


def detokenize(tokens: bytes | bytearray, n: int) -> str:
    return "".join([WORDS[t] for t in tokens[:n]])


DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"

# vLLM-style error type names (`type` is a class-like name, `code` the integer status).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
    529: "OverloadedError",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def error_obj(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def error_body(message: str, status: int, param: str | None = None) -> bytes:
    """OpenAI-format error body: {"error":{"message","type","param","code"}}."""
    return orjson.dumps(error_obj(message, status, param))


def usage_obj(seq: Any) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": seq.prompt_tokens,
        "completion_tokens": seq.generated,
        "total_tokens": seq.prompt_tokens + seq.generated,
    }
    if seq.report_cached:
        u["prompt_tokens_details"] = {"cached_tokens": seq.cached_tokens}
    return u


def _head(rid: str, obj: str, created: int, model: str) -> bytes:
    return (
        b'{"id":' + orjson.dumps(rid) + b',"object":"' + obj.encode() + b'","created":'
        + str(created).encode() + b',"model":' + orjson.dumps(model)
    )


class OpenAIChatStream:
    """`chat.completion.chunk` events, vLLM style (compact JSON, no usage key except on usage chunk)."""

    __slots__ = ("head", "pre", "suf", "role_chunk")
    ping = PING

    def __init__(self, rid: str, created: int, model: str) -> None:
        self.head = _head(rid, "chat.completion.chunk", created, model)
        self.pre = b"data: " + self.head + b',"choices":[{"index":0,"delta":{"content":"'
        self.suf = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
        self.role_chunk = (
            b"data: " + self.head
            + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def opening(self, role_first: bool) -> bytes:
        return self.role_chunk if role_first else b""

    def first(self, tid: int, role_sent: bool) -> bytes:
        tok = self.pre + WORDS_JSON[tid] + self.suf
        return tok if role_sent else self.role_chunk + tok

    def token(self, tid: int) -> bytes:
        return self.pre + WORDS_JSON[tid] + self.suf

    def finish(self, seq: Any, include_usage: bool) -> bytes:
        out = (
            b"data: " + self.head + b',"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"'
            + seq.finish_reason.encode() + b'"}]}\n\n'
        )
        if include_usage:
            out += b"data: " + self.head + b',"choices":[],"usage":' + orjson.dumps(usage_obj(seq)) + b"}\n\n"
        return out + DONE

    def error(self, message: str, status: int) -> bytes:
        return b"data: " + error_body(message, status) + b"\n\n" + DONE


class OpenAICompletionStream:
    """Legacy `text_completion` stream events (no role chunk)."""

    __slots__ = ("head", "pre", "suf")
    ping = PING

    def __init__(self, rid: str, created: int, model: str) -> None:
        self.head = _head(rid, "text_completion", created, model)
        self.pre = b"data: " + self.head + b',"choices":[{"index":0,"text":"'
        self.suf = b'","logprobs":null,"finish_reason":null}]}\n\n'

    def opening(self, role_first: bool) -> bytes:
        return b""

    def first(self, tid: int, role_sent: bool) -> bytes:
        return self.pre + WORDS_JSON[tid] + self.suf

    def token(self, tid: int) -> bytes:
        return self.pre + WORDS_JSON[tid] + self.suf

    def finish(self, seq: Any, include_usage: bool) -> bytes:
        out = (
            b"data: " + self.head + b',"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"'
            + seq.finish_reason.encode() + b'"}]}\n\n'
        )
        if include_usage:
            out += b"data: " + self.head + b',"choices":[],"usage":' + orjson.dumps(usage_obj(seq)) + b"}\n\n"
        return out + DONE

    def error(self, message: str, status: int) -> bytes:
        return b"data: " + error_body(message, status) + b"\n\n" + DONE


# --- non-streaming bodies ----------------------------------------------------------------------

def chat_body(rid: str, created: int, model: str, seq: Any) -> bytes:
    return orjson.dumps({
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": detokenize(seq.tokens, seq.generated), "tool_calls": []},
            "logprobs": None,
            "finish_reason": seq.finish_reason,
        }],
        "usage": usage_obj(seq),
    })


def completion_body(rid: str, created: int, model: str, seq: Any) -> bytes:
    return orjson.dumps({
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "text": detokenize(seq.tokens, seq.generated),
            "logprobs": None,
            "finish_reason": seq.finish_reason,
        }],
        "usage": usage_obj(seq),
    })


def models_body(names: list[str], created: int) -> bytes:
    return orjson.dumps({
        "object": "list",
        "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "slogate-sim", "root": n,
             "parent": None, "max_model_len": None}
            for n in names
        ],
    })
