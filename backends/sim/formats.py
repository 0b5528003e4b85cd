"""Wire renderers: turn the engine's token ids and finished sequences into API bytes.

Each streaming renderer is one object per request with precomputed byte templates, so a token
costs a few byte concatenations and no JSON encoding. The engine knows nothing about formats;
the server picks a renderer per route. Every renderer has these methods:

    opening(role_first) -> bytes   events written right after the response headers
    first(tid, role_sent) -> bytes the first token (with the role chunk unless sent already)
    token(tid) -> bytes            every later token
    finish(seq, include_usage) -> bytes   closing events, usage, terminator
    error(message, status) -> bytes       a mid-stream error event and terminator
    ping: bytes                    a keep-alive that is not a token

This module: the vocabulary, the answer's plan (`Output`: reasoning tokens first, then text or
one tool call), the provider-reported timings, and the OpenAI chat / completions formats with
their vLLM, Groq and Cerebras flavours. anthropic_format.py and responses_format.py hold the
other two wire formats.

`seq` (engine.Seq) carries prompt/completion counts, cached tokens and the monotonic stamps
t_arrival, t_scheduled, t_prefill_done, t_first, t_last, t_end that the timing fields need.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
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
measure move need offer read remember send show start stop think try turn wait watch
write""".split()
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



# Each token as a fragment of a JSON string that is itself inside a JSON string (tool-call
# arguments are a JSON document streamed as string fragments): escaped twice.
WORDS_ARG_JSON: list[bytes] = [orjson.dumps(w.decode())[1:-1] for w in WORDS_JSON]
# A tool call's arguments are `{"text":"<the tokens>"}`; its opening and closing fragments,
# escaped for a JSON string.
ARGS_OPEN = orjson.dumps('{"text":"')[1:-1]
ARGS_CLOSE = orjson.dumps('"}')[1:-1]


def detokenize(tokens: bytes | bytearray, n: int, start: int = 0) -> str:
    return "".join([WORDS[t] for t in tokens[start:n]])


def tool_arguments(text: str) -> str:
    """The arguments JSON a tool call streams, as one string (equals the joined fragments)."""
    return orjson.dumps({"text": text}).decode()


DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
FINGERPRINT = "fp_slogate_sim"


@dataclass(frozen=True, slots=True)
class Output:
    """What one answer is made of: the first `reasoning` tokens are reasoning, the rest are
    text, or the arguments of one call of the tool named `tool`. `flavour` picks the provider
    extras of OpenAI-format chunks (vllm, groq, cerebras)."""

    reasoning: int = 0
    tool: str | None = None
    flavour: str = "vllm"
    per_request_metrics: bool = False  # vLLM's `metrics` object (--enable-per-request-metrics)
    # usage.prompt_tokens_details.cached_tokens: Groq and Cerebras always send it, vLLM only
    # with --enable-prompt-tokens-details
    cache_details: bool = False
    terminator: bool = True  # end streams with their terminal event (off: the no_terminator fault)

    def parts(self, seq: Any) -> tuple[str, str]:
        """(reasoning text, text or tool-argument text) of a finished sequence."""
        n = seq.generated
        cut = min(self.reasoning, n)
        return detokenize(seq.tokens, cut), detokenize(seq.tokens, n, cut)

    def called_tool(self, seq: Any) -> bool:
        """The answer got as far as the tool call."""
        return self.tool is not None and seq.generated > self.reasoning


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
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": status}}


def error_body(message: str, status: int, param: str | None = None) -> bytes:
    """OpenAI-format error body: {"error":{"message","type","param","code"}}."""
    return orjson.dumps(error_obj(message, status, param))


def usage_obj(seq: Any, out: Output | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": seq.prompt_tokens,
        "completion_tokens": seq.generated,
        "total_tokens": seq.prompt_tokens + seq.generated,
    }
    if out is not None and out.cache_details:
        u["prompt_tokens_details"] = {"cached_tokens": seq.cached_tokens}
    if out is not None and out.reasoning:
        u["completion_tokens_details"] = {"reasoning_tokens": min(out.reasoning, seq.generated)}
    return u


# --- provider-reported timings, from the engine's own stamps (seconds) ---------------------------

def stage_seconds(seq: Any) -> tuple[float, float, float]:
    """(queue, prefill, decode) as the engine lived them: waiting -> scheduled -> prompt done
    -> last token."""
    return (round(seq.t_scheduled - seq.t_arrival, 6),
            round(seq.t_prefill_done - seq.t_scheduled, 6),
            round(max(0.0, seq.t_last - seq.t_prefill_done), 6))


def groq_usage(seq: Any) -> dict[str, Any]:
    """Groq's CompletionUsage with timings (total_time = prompt + completion, no queue)."""
    queue, prompt, completion = stage_seconds(seq)
    return {"queue_time": queue, "prompt_tokens": seq.prompt_tokens, "prompt_time": prompt,
            "completion_tokens": seq.generated, "completion_time": completion,
            "total_tokens": seq.prompt_tokens + seq.generated,
            "total_time": round(prompt + completion, 6),
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}


def time_info(seq: Any) -> dict[str, Any]:
    """Cerebras `time_info` (total_time includes the queue and overhead)."""
    queue, prompt, completion = stage_seconds(seq)
    return {"queue_time": queue, "prompt_time": prompt, "completion_time": completion,
            "total_time": round(seq.t_end - seq.t_arrival, 6), "created": time.time()}


def vllm_metrics(seq: Any) -> dict[str, Any]:
    """vLLM's per-request `metrics` (milliseconds; TTFT counts from arrival)."""
    n = seq.generated
    generation_ms = (seq.t_last - seq.t_first) * 1e3
    return {"time_to_first_token_ms": round((seq.t_first - seq.t_arrival) * 1e3, 3),
            "queue_time_ms": round((seq.t_scheduled - seq.t_arrival) * 1e3, 3),
            "generation_time_ms": round(generation_ms, 3),
            "mean_itl_ms": round(generation_ms / (n - 1), 3) if n > 1 else 0.0,
            "tokens_per_second": round(n / max(seq.t_end - seq.t_arrival, 1e-9), 3)}


def groq_request_id(rid: str) -> str:
    return "req_" + rid.partition("-")[2]


def tool_call_id(rid: str) -> str:
    return "call_" + rid.partition("-")[2]


def _head(rid: str, obj: str, created: int, model: str, flavour: str) -> bytes:
    head = (b'{"id":' + orjson.dumps(rid) + b',"object":"' + obj.encode() + b'","created":'
            + str(created).encode() + b',"model":' + orjson.dumps(model))
    if flavour != "vllm":  # hosted APIs always send it; the Cerebras SDK needs it
        head += b',"system_fingerprint":"' + FINGERPRINT.encode() + b'"'
    return head


# --- OpenAI chat / completions streams -----------------------------------------------------------

_OPEN_CHOICE = b',"choices":[{"index":0,"delta":{'
_CLOSE_CHOICE = b',"logprobs":null,"finish_reason":null}]}\n\n'


class _OpenAIStream:
    """What chat and completions streams share: the flavour's closing chunks."""

    __slots__ = ("head", "out", "rid")
    ping = PING
    head: bytes  # set by each subclass's __init__
    out: Output
    rid: str

    def _closing(self, seq: Any, include_usage: bool, choice: bytes) -> bytes:
        """The finish chunk (`choice` is its choices entry), the usage chunk, [DONE].
        Groq puts x_groq.usage on the finish chunk; Cerebras sends usage and time_info in every
        stream; vLLM adds its `metrics` to the usage chunk when enabled."""
        out = self.out
        finish = b"data: " + self.head + b',"choices":[' + choice + b"]"
        if out.flavour == "groq":
            finish += b',"x_groq":' + orjson.dumps({"id": groq_request_id(self.rid),
                                                    "usage": groq_usage(seq)})
        data = finish + b"}\n\n"
        if include_usage or out.flavour == "cerebras":
            usage = (b"data: " + self.head + b',"choices":[],"usage":'
                     + orjson.dumps(usage_obj(seq, out)))
            if out.flavour == "cerebras":
                usage += b',"time_info":' + orjson.dumps(time_info(seq))
            elif out.flavour == "vllm" and out.per_request_metrics:
                usage += b',"metrics":' + orjson.dumps(vllm_metrics(seq))
            data += usage + b"}\n\n"
        return data + self.done

    @property
    def done(self) -> bytes:
        return DONE if self.out.terminator else b""

    def error(self, message: str, status: int) -> bytes:
        return b"data: " + error_body(message, status) + b"\n\n" + self.done


class OpenAIChatStream(_OpenAIStream):
    """`chat.completion.chunk` events (compact JSON, `usage` only on the usage chunk): the
    reasoning tokens as `delta.reasoning`, then content, or one tool call whose first chunk
    names it and whose arguments follow as fragments."""

    __slots__ = ("role_chunk", "role_out", "n", "reasoning_pre", "body_pre", "body_suf", "words",
                 "tool_open")

    def __init__(self, rid: str, created: int, model: str, out: Output) -> None:
        self.rid = rid
        self.out = out
        self.n = 0
        self.role_out = False
        self.head = head = _head(rid, "chat.completion.chunk", created, model, out.flavour)
        start = b"data: " + head + _OPEN_CHOICE
        x_groq = (b',"x_groq":{"id":"' + groq_request_id(rid).encode() + b'"}'
                  if out.flavour == "groq" else b"")
        self.role_chunk = (start + b'"role":"assistant","content":""},"logprobs":null,'
                           b'"finish_reason":null}]' + x_groq + b"}\n\n")
        self.reasoning_pre = start + b'"reasoning":"'
        if out.tool is None:
            self.body_pre, self.body_suf = start + b'"content":"', b'"}' + _CLOSE_CHOICE
            self.words = WORDS_JSON
            self.tool_open = b""
        else:
            self.body_pre = start + b'"tool_calls":[{"index":0,"function":{"arguments":"'
            self.body_suf, self.words = b'"}}]}' + _CLOSE_CHOICE, WORDS_ARG_JSON
            call = {"index": 0, "id": tool_call_id(rid), "type": "function",
                    "function": {"name": out.tool, "arguments": ""}}
            self.tool_open = (start + b'"tool_calls":[' + orjson.dumps(call) + b"]}"
                              + _CLOSE_CHOICE)

    def opening(self, role_first: bool) -> bytes:
        self.role_out = role_first
        return self.role_chunk if role_first else b""

    def first(self, tid: int, role_sent: bool) -> bytes:
        tok = self.token(tid)
        self.role_out = True
        return tok if role_sent else self.role_chunk + tok

    def token(self, tid: int) -> bytes:
        i = self.n
        self.n = i + 1
        reasoning = self.out.reasoning
        if i > reasoning or (i == reasoning and not self.tool_open):
            return self.body_pre + self.words[tid] + self.body_suf
        if i < reasoning:
            return self.reasoning_pre + WORDS_JSON[tid] + b'"}' + _CLOSE_CHOICE
        # the first tool token: the call's name, then the arguments' opening fragment
        return self.tool_open + self.body_pre + ARGS_OPEN + self.words[tid] + self.body_suf

    def finish(self, seq: Any, include_usage: bool) -> bytes:
        reason = seq.finish_reason
        # an answer of no tokens (a prefill that was already the whole answer) still has a role
        closing = b"" if self.role_out else self.role_chunk
        if self.out.called_tool(seq):
            closing += self.body_pre + ARGS_CLOSE + self.body_suf
            if reason == "stop":
                reason = "tool_calls"
        choice = (b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"' + reason.encode()
                  + b'"}')
        return closing + self._closing(seq, include_usage, choice)


class OpenAICompletionStream(_OpenAIStream):
    """Legacy `text_completion` stream events (no role chunk)."""

    __slots__ = ("pre", "suf")

    def __init__(self, rid: str, created: int, model: str, out: Output) -> None:
        self.rid = rid
        self.out = out
        self.head = _head(rid, "text_completion", created, model, out.flavour)
        self.pre = b"data: " + self.head + b',"choices":[{"index":0,"text":"'
        self.suf = b'","logprobs":null,"finish_reason":null}]}\n\n'

    def opening(self, role_first: bool) -> bytes:
        return b""

    def first(self, tid: int, role_sent: bool) -> bytes:
        return self.pre + WORDS_JSON[tid] + self.suf

    def token(self, tid: int) -> bytes:
        return self.pre + WORDS_JSON[tid] + self.suf

    def finish(self, seq: Any, include_usage: bool) -> bytes:
        choice = (b'{"index":0,"text":"","logprobs":null,"finish_reason":"'
                  + seq.finish_reason.encode() + b'"}')
        return self._closing(seq, include_usage, choice)


# --- non-streaming bodies ----------------------------------------------------------------------

def _with_flavour(body: dict[str, Any], rid: str, seq: Any, out: Output) -> bytes:
    """Provider extras of a whole response: Groq's timings sit in `usage` (its x_groq.usage is
    cache statistics there), Cerebras adds time_info, vLLM its metrics."""
    if out.flavour == "groq":
        body["usage"].update(groq_usage(seq))
        body["x_groq"] = {"id": groq_request_id(rid)}
    elif out.flavour == "cerebras":
        body["time_info"] = time_info(seq)
    elif out.per_request_metrics:
        body["metrics"] = vllm_metrics(seq)
    if out.flavour != "vllm":
        body["system_fingerprint"] = FINGERPRINT
    return orjson.dumps(body)


def chat_body(rid: str, created: int, model: str, seq: Any, out: Output = Output()) -> bytes:
    reasoning, text = out.parts(seq)
    message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
    reason = seq.finish_reason
    if out.called_tool(seq):
        message["content"] = None
        message["tool_calls"] = [{"id": tool_call_id(rid), "type": "function",
                                  "function": {"name": out.tool,
                                               "arguments": tool_arguments(text)}}]
        reason = "tool_calls" if reason == "stop" else reason
    if reasoning:
        message["reasoning"] = reasoning
    return _with_flavour({
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
        "usage": usage_obj(seq, out),
    }, rid, seq, out)


def completion_body(rid: str, created: int, model: str, seq: Any, out: Output = Output()) -> bytes:
    return _with_flavour({
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
        "usage": usage_obj(seq, out),
    }, rid, seq, out)


def models_body(names: list[str], created: int) -> bytes:
    return orjson.dumps({
        "object": "list",
        "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "slogate-sim", "root": n,
             "parent": None, "max_model_len": None}
            for n in names
        ],
    })
