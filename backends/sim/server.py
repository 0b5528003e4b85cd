"""HTTP surface of the simulator: OpenAI chat / completions / Responses and Anthropic Messages
routes (with vLLM, Groq and Cerebras flavours), metrics, introspection, faults.

Streaming responses are written straight to the transport with precomputed chunked-encoding
frames from the engine's step callback: no coroutine switch, no JSON encoding, one write per
token per stream.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import anthropic_format, formats, responses_format
from .config import ERROR_KINDS, HANG_MODES, PROVIDERS, SimConfig, updated
from .engine import CANCELLED, CUT, ERROR, FINISHED, LENGTH, STOP, Engine, QueueFull, Seq
from .metrics import SimMetrics
from .prefill import Plan, Prefill, start_of

JSON = "application/json"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


class SimState:
    """Everything one simulator app owns: engine, metrics registry, request log, counters."""

    def __init__(self, cfg: SimConfig) -> None:
        cfg.validate()
        self.engine = Engine(cfg)
        self.requests_total = 0
        self.faults: collections.Counter[str] = collections.Counter()
        self.request_log: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=cfg.request_log_size)
        self.rng = random.Random(cfg.seed)
        self.active: set[asyncio.Task[Any]] = set()
        self.created = int(time.time())
        self.hanging = 0
        self.knob_status_faults = 0  # requests answered with the fault_status knob so far
        self.stall_rng = random.Random(f"stall:{cfg.seed}")  # apart: stalls leave status draws be
        self.metrics = SimMetrics(self)

    @property
    def cfg(self) -> SimConfig:
        return self.engine.cfg

    def set_config(self, cfg: SimConfig) -> None:
        if cfg.request_log_size != self.request_log.maxlen:
            self.request_log = collections.deque(self.request_log, maxlen=cfg.request_log_size)
        self.engine.cfg = cfg

    def knob_status(self) -> int:
        """The fault_status knob's status if this request gets it (rate, count), else 0."""
        cfg = self.cfg
        if not cfg.fault_status or not (cfg.fault_status_rate >= 1.0
                                        or self.rng.random() < cfg.fault_status_rate):
            return 0
        if 0 <= cfg.fault_status_count <= self.knob_status_faults:
            return 0
        self.knob_status_faults += 1
        return cfg.fault_status

    def stalls(self, rate: float) -> bool:
        """Whether this request is among the `rate` share that gets the stall."""
        return rate >= 1.0 or self.stall_rng.random() < rate

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        s["requests"] = self.requests_total
        s["hanging"] = self.hanging
        s["faults"] = dict(self.faults)
        return s


SIM = web.AppKey("sim", SimState)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A route's API: how its request reads and how its answers and errors are written."""

    api: str  # "chat", "completions", "responses" or "messages"
    id_prefix: str
    provider: str | None = None  # flavour this route implies (Groq's /openai/v1), else the knob


CHAT = Endpoint("chat", "chatcmpl-")
GROQ_CHAT = Endpoint("chat", "chatcmpl-", "groq")
COMPLETIONS = Endpoint("completions", "cmpl-")
RESPONSES = Endpoint("responses", "resp_")
MESSAGES = Endpoint("messages", "msg_")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None, api: str = "chat") -> web.Response:
    """An error in the route's format: Anthropic's error object for Messages, else vLLM's."""
    body = (anthropic_format.error_body(message, status) if api == "messages"
            else formats.error_body(message, status, param))
    return web.Response(status=status, reason=_REASONS.get(status), headers=headers,
                        body=body, content_type=JSON)


_REASONS = {529: "Site Overloaded"}  # statuses without a standard reason phrase


# --- per-request fault knobs --------------------------------------------------------------------

@dataclass(slots=True)
class Faults:
    stall_ms: float  # 0 when this request is not among stall_rate's share
    token_delay_ms: float
    cut_after: int
    error_after: int
    status: int
    retry_after: str | None
    hang: str
    ping_ms: float
    role_first: bool
    output_tokens: int
    reasoning_tokens: int | None  # None: the knob's count, if the request asks for reasoning
    provider: str | None  # None: the route's or the knob's flavour
    error_type: str = "api_error"  # what an error_after error is
    linger_ms: float = 0.0
    no_terminator: bool = False
    max_model_len: int = 32768
    continuation: bool = True

    @property
    def error_status(self) -> int:
        return 529 if self.error_type == "overloaded_error" else 500


def _hnum(h: Any, name: str, default: float, conv: type, lo: float) -> Any:
    v = h.get(name)
    if v is None:
        return default
    try:
        x = conv(v.strip())
    except ValueError:
        raise BadRequest(f"header {name}: {v!r} is not a valid {conv.__name__}", name) from None
    if not (x >= lo) or (conv is float and math.isinf(x)):
        raise BadRequest(f"header {name}: {v!r} must be >= {lo}", name)
    return x


def _hrate(h: Any, name: str, default: float) -> float:
    x: float = _hnum(h, name, default, float, 0)
    if x > 1:
        raise BadRequest(f"header {name}: {x!r} must be a fraction 0..1", name)
    return x


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _hbool(h: Any, name: str, default: bool) -> bool:
    v = h.get(name)
    if v is None:
        return default
    v = str(v).strip().lower()
    if v not in _TRUE + _FALSE:
        raise BadRequest(f"header {name}: {v!r} is not one of 1, 0, true, false", name)
    return v in _TRUE


def _hchoice(h: Any, name: str, default: str, choices: tuple[str, ...]) -> str:
    v = h.get(name)
    if v is None:
        return default
    v = str(v).strip().lower()
    if v not in choices:
        raise BadRequest(f"header {name}: {v!r} is not one of "
                         f"{', '.join(repr(c) for c in choices if c)}", name)
    return v


def parse_faults(h: Any, sim: SimState) -> Faults:
    cfg = sim.cfg
    status = _hnum(h, "x-sim-status", 0, int, 0)
    if status and not 400 <= status <= 599:
        raise BadRequest(f"header x-sim-status: {status} is not an HTTP error status 400-599",
                         "x-sim-status")
    if not status:
        status = sim.knob_status()
    retry_after = h.get("x-sim-retry-after")
    if retry_after is None and cfg.retry_after_s >= 0:
        retry_after = f"{cfg.retry_after_s:g}"
    rf = h.get("x-sim-role-first")
    role_first = cfg.role_first if rf is None else rf.strip().lower() in _TRUE
    provider = h.get("x-sim-provider")
    if provider is not None:
        provider = _hchoice(h, "x-sim-provider", "", PROVIDERS)
    reasoning = h.get("x-sim-reasoning-tokens")
    stall_ms = _hnum(h, "x-sim-stall-ms", cfg.stall_ms, float, 0)
    if stall_ms and not sim.stalls(_hrate(h, "x-sim-stall-rate", cfg.stall_rate)):
        stall_ms = 0.0
    return Faults(
        stall_ms=stall_ms,
        token_delay_ms=_hnum(h, "x-sim-token-delay-ms", cfg.token_delay_ms, float, 0),
        cut_after=_hnum(h, "x-sim-cut-after", cfg.cut_after, int, -1),
        error_after=_hnum(h, "x-sim-error-after", cfg.error_after, int, -1),
        status=status,
        retry_after=retry_after,
        hang=_hchoice(h, "x-sim-hang", cfg.hang, HANG_MODES),
        ping_ms=_hnum(h, "x-sim-ping-ms", cfg.ping_ms, float, 0),
        role_first=role_first,
        output_tokens=_hnum(h, "x-sim-output-tokens", cfg.output_tokens, int, 0),
        reasoning_tokens=(None if reasoning is None
                          else _hnum(h, "x-sim-reasoning-tokens", 0, int, 0)),
        provider=provider,
        error_type=_hchoice(h, "x-sim-error-type", cfg.error_type, ERROR_KINDS),
        linger_ms=_hnum(h, "x-sim-linger-ms", cfg.linger_ms, float, 0),
        no_terminator=_hbool(h, "x-sim-no-terminator", cfg.no_terminator),
        max_model_len=_hnum(h, "x-sim-max-model-len", cfg.max_model_len, int, 2),
        continuation=_hbool(h, "x-sim-continuation", cfg.continuation),
    )


# --- request body -------------------------------------------------------------------------------

@dataclass(slots=True)
class Parsed:
    model: str
    stream: bool
    include_usage: bool | None  # None: stream_options given without include_usage
    max_tokens: int | None
    seed: int | None
    prompt: bytes
    prompt_tokens: int
    tool: str | None = None  # the tool the answer calls (the request's first tool)
    wants_reasoning: bool = False
    prefill: Prefill | None = None  # the final assistant message to continue
    seed_prompt: bytes | None = None  # the prompt without the prefill (None: `prompt`)


def _opt_int(body: dict[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if v < lo:
        raise BadRequest(f"'{key}' must be at least {lo}, got {v}", key)
    return v


def _text_parts(content: Any, where: str, param: str) -> list[bytes]:
    """The text of a message's content: a string, or a list of parts/blocks with `text` (tool
    results may nest another content list)."""
    if isinstance(content, str):
        return [content.encode()]
    if content is None:
        return []
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string, a list of parts or null", param)
    parts: list[bytes] = []
    for p in content:
        if not isinstance(p, dict):
            raise BadRequest(f"{where}.content parts must be objects", param)
        if isinstance(p.get("text"), str):
            parts.append(p["text"].encode())
        elif isinstance(p.get("content"), (str, list)):
            parts.extend(_text_parts(p["content"], where, param))
    return parts


def _messages_prompt(msgs: Any, system: Any = None, drop_last: bool = False) -> tuple[bytes, int]:
    """The messages' text joined (for hashing and the prefix cache) and its content byte count;
    `drop_last`: without the final message (a prefill)."""
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    parts: list[bytes] = _text_parts(system, "system", "system") if system is not None else []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        if not (drop_last and i == len(msgs) - 1):
            parts.extend(_text_parts(m.get("content"), f"messages[{i}]", "messages"))
    return b"\n".join(parts), sum(map(len, parts))


# vLLM's words: its request validator, and (add_generation_prompt defaults to true there) the chat
# template's refusal when only continue_final_message is set
_BOTH_SET = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
_NOT_COMPATIBLE = (
    "continue_final_message and add_generation_prompt are not compatible. Use "
    "continue_final_message when you want the model to continue the final message, and "
    "add_generation_prompt when you want to add a header that will prompt it to start a new "
    "assistant message instead.")


def _opt_bool(body: dict[str, Any], key: str) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be a boolean", key)
    return v


def _chat_prefill(body: dict[str, Any], continuation: bool) -> Prefill | None:
    """vLLM's continue_final_message: the final assistant message is continued, not answered."""
    agp = _opt_bool(body, "add_generation_prompt")
    if not _opt_bool(body, "continue_final_message"):
        return None
    if not continuation:  # what an OpenAI-compatible server without the extension says
        raise BadRequest("Unrecognized request argument supplied: continue_final_message",
                         "continue_final_message")
    if agp is not False:
        raise BadRequest(_BOTH_SET if agp else _NOT_COMPATIBLE)
    last = body["messages"][-1]
    if last["role"] != "assistant":  # nothing of the answer to continue
        return None
    parts = _text_parts(last.get("content"), "the final message", "messages")
    text = b"\n".join(parts).decode()  # vLLM joins text parts with newlines
    thinking = next((t for k in ("reasoning", "reasoning_content")
                     if isinstance(t := last.get(k), str)), "")
    return Prefill(text, thinking, sum(map(len, parts)))


def _messages_prefill(msgs: list[Any], continuation: bool) -> Prefill | None:
    """Anthropic's prefill: a final assistant message is the start of the answer."""
    last = msgs[-1]
    if last["role"] != "assistant":
        return None
    if not continuation:
        raise BadRequest("prefill not supported", "messages")
    content = last.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        blocks = []
    blocks = [b for b in blocks if isinstance(b, dict)]
    text = "".join(b["text"] for b in blocks if b.get("type") == "text"
                   and isinstance(b.get("text"), str))
    thinking = "".join(b["thinking"] for b in blocks if b.get("type") == "thinking"
                       and isinstance(b.get("thinking"), str))
    if text != text.rstrip():
        raise BadRequest("final assistant content cannot end with trailing whitespace", "messages")
    return Prefill(text, thinking, len(text.encode()))


def _responses_prompt(body: dict[str, Any]) -> tuple[bytes, int]:
    """`input` (a string or a list of items) and `instructions`."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items", "input")
    parts: list[bytes] = []
    if isinstance(body.get("instructions"), str):
        parts.append(body["instructions"].encode())
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object", "input")
        if isinstance(item.get("output"), str):  # a function call's result
            parts.append(item["output"].encode())
        parts.extend(_text_parts(item.get("content"), f"input[{i}]", "input"))
    return b"\n".join(parts), sum(map(len, parts))


def _first_tool(body: dict[str, Any], api: str) -> str | None:
    """The name of the request's first callable tool, unless tool_choice rules tools out."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    choice = body.get("tool_choice")
    if choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    for t in tools:
        if not isinstance(t, dict):
            raise BadRequest("'tools' must be a list of objects", "tools")
        fn = t.get("function") if api == "chat" else t
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str):
            return name
    return None


def _wants_reasoning(body: dict[str, Any], api: str) -> bool:
    if api == "messages":
        thinking = body.get("thinking")
        return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")
    if api == "responses":
        reasoning = body.get("reasoning")
        return isinstance(reasoning, dict) and reasoning.get("effort") not in (None, "none")
    return body.get("reasoning_effort") not in (None, "none")


def _completion_prompt(body: dict[str, Any]) -> tuple[bytes, int | None]:
    """Prompt bytes, and the token count when the prompt is given as token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p.encode(), None
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return orjson.dumps(p), len(p)
    if isinstance(p, list) and len(p) > 1:
        raise BadRequest("the simulator serves one prompt per request", "prompt")
    raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")


def _stream_options(body: dict[str, Any], stream: bool) -> bool | None:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    if not stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
    iu = so.get("include_usage")
    if iu is not None and not isinstance(iu, bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean", "stream_options")
    return iu


def parse_body(body: Any, api: str, cfg: SimConfig, continuation: bool = True) -> Parsed:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = cfg.served_model_names[0]
    elif not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    elif not cfg.accept_any_model and model not in cfg.served_model_names:
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    include_usage = _stream_options(body, stream) if api in ("chat", "completions") else True
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequest("the simulator supports only n=1", "n")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer", "seed")
    if api == "completions":
        mt = _opt_int(body, "max_tokens", 1)
        prompt, ptoks = _completion_prompt(body)
        if ptoks is None:
            ptoks = max(1, -(-len(prompt) // cfg.bytes_per_token))
        return Parsed(model, stream, include_usage, mt, seed, prompt, ptoks)
    p = _conversation(body, api, cfg, continuation)
    p.model, p.stream, p.include_usage, p.seed = model, stream, include_usage, seed
    return p


def _conversation(body: dict[str, Any], api: str, cfg: SimConfig, continuation: bool) -> Parsed:
    """The chat, Responses or Messages request's prompt, limit, tool, reasoning and prefill."""
    system = None
    if api == "chat":
        mt = _opt_int(body, "max_tokens", 1)
        mct = _opt_int(body, "max_completion_tokens", 1)
        if mct is not None:
            mt = mct
        prompt, nbytes = _messages_prompt(body.get("messages"))
        prefill = _chat_prefill(body, continuation)
    elif api == "responses":
        mt = _opt_int(body, "max_output_tokens", 1)
        prompt, nbytes = _responses_prompt(body)
        prefill = None
    else:
        mt = _opt_int(body, "max_tokens", 1)
        if mt is None:
            raise BadRequest("max_tokens: Field required", "max_tokens")
        system = body.get("system")
        prompt, nbytes = _messages_prompt(body.get("messages"), system)
        prefill = _messages_prefill(body["messages"], continuation)
    seed_prompt = None
    if prefill is not None:  # the prefill's tokens are added once it is matched to the plan
        seed_prompt, nbytes = _messages_prompt(body["messages"], system, drop_last=True)
    ptoks = max(1, -(-nbytes // cfg.bytes_per_token))
    return Parsed("", False, None, mt, None, prompt, ptoks, _first_tool(body, api),
                  _wants_reasoning(body, api), prefill, seed_prompt)


def check_context(p: Parsed, api: str, limit: int) -> None:
    """A 400 for a prompt (prefill included) and max_tokens the context cannot hold, in vLLM's
    words, or Anthropic's for Messages."""
    ptoks, mt = p.prompt_tokens, p.max_tokens
    if api == "messages":
        if ptoks > limit:
            raise BadRequest(f"prompt is too long: {ptoks} tokens > {limit} maximum", "messages")
        if mt is not None and ptoks + mt > limit:
            raise BadRequest(f"input length and `max_tokens` exceed context limit: {ptoks} + {mt} "
                             f"> {limit}, decrease input length or `max_tokens` and try again",
                             "max_tokens")
        return
    if ptoks >= limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens. However, your "
                         f"request has {ptoks} input tokens. Please reduce the length of the "
                         "input messages.", "input_tokens")
    if mt is not None and ptoks + mt > limit:
        raise BadRequest(f"'max_tokens' or 'max_completion_tokens' is too large: {mt}. This "
                         f"model's maximum context length is {limit} tokens and your request has "
                         f"{ptoks} input tokens ({mt} > {limit} - {ptoks}).", "max_tokens")


@dataclass(slots=True)
class Answer:
    """What the engine will produce for a request: the token ids, how it ends, how many of them
    are reasoning, and where in its plan it starts (a continued prefill's K)."""

    tokens: bytes
    target: int
    reason: str
    reasoning: int
    start: int = 0
    exact: bool = True


def _rng(p: Parsed, cfg: SimConfig) -> random.Random:
    if p.seed is not None:
        return random.Random(f"{cfg.seed}:{p.seed}")
    prompt = p.prompt if p.seed_prompt is None else p.seed_prompt
    return random.Random(hashlib.blake2b(prompt, digest_size=16, person=b"%d" % cfg.seed).digest())


def _reasoning(p: Parsed, f: Faults, cfg: SimConfig) -> int:
    if f.reasoning_tokens is not None:
        return f.reasoning_tokens
    return cfg.reasoning_tokens if p.wants_reasoning else 0


def _length(p: Parsed, f: Faults, cfg: SimConfig, drawn: int, start: int) -> tuple[int, str]:
    """(new tokens, finish reason). The answer's own end (forced, drawn, or none under
    max_tokens) is a plan position; a continuation from `start` has what is left of it."""
    end, reason = (f.output_tokens, STOP) if f.output_tokens else (
        (drawn, STOP) if p.max_tokens is None else (math.inf, LENGTH))
    new = max(0, end - start)
    if p.max_tokens is not None and p.max_tokens < new:
        new, reason = p.max_tokens, LENGTH
    # the output cap counts the prefill too, so a continuation ends where the answer would have
    room = min(cfg.max_output_tokens - start, f.max_model_len - p.prompt_tokens)
    if new > room:
        new, reason = max(0, room), LENGTH
    return int(new), reason


def plan_answer(p: Parsed, f: Faults, cfg: SimConfig, api: str) -> Answer:
    """The answer's tokens; a prefill is matched to the plan and its tokens join the prompt.
    Raises BadRequest when the context cannot hold the request."""
    rng = _rng(p, cfg)
    sigma = cfg.output_tokens_sigma
    mu = math.log(cfg.mean_output_tokens) - sigma * sigma / 2
    drawn = max(1, round(rng.lognormvariate(mu, sigma)))
    plan = Plan(rng)
    reasoning = _reasoning(p, f, cfg)
    start, exact = 0, True
    if p.prefill is not None:
        if p.tool is None:
            start, exact = start_of(plan, reasoning, p.prefill, cfg.bytes_per_token)
            p.prompt_tokens += start
        else:  # a tool call is not continued: the answer starts over, the prefill is prompt
            exact = False
            p.prompt_tokens += -(-p.prefill.prompt_bytes // cfg.bytes_per_token)
    check_context(p, api, f.max_model_len)
    target, reason = _length(p, f, cfg, drawn, start)
    return Answer(plan.tokens(start + target)[start:], target, reason,
                  max(0, reasoning - start), start, exact)


def make_seq(p: Parsed, f: Faults, cfg: SimConfig, engine: Engine, a: Answer) -> Seq:
    cached = written = 0
    key = None
    if cfg.prefix_cache_bytes:
        head = p.prompt[: cfg.prefix_cache_bytes]
        key = (len(head), hash(head))
        prefix_tokens = min(len(head) // cfg.bytes_per_token, p.prompt_tokens - 1)
        cached = engine.lookup_prefix(key, prefix_tokens)
        written = 0 if cached else prefix_tokens  # a miss fills the cache once prefilled
    return Seq(
        p.prompt_tokens, a.target, a.reason, a.tokens,
        cached_tokens=cached,
        cache_write_tokens=written,
        prefix_key=key,
        stall_s=math.inf if f.hang == "first_token" else f.stall_ms / 1000.0,
        token_delay_s=f.token_delay_ms / 1000.0,
        cut_after=f.cut_after,
        error_after=f.error_after,
    )


# --- streaming sink -----------------------------------------------------------------------------

class StreamSink:
    """Receives engine callbacks for one streaming request and writes SSE bytes to the socket."""

    __slots__ = ("engine", "seq", "fmt", "include_usage", "role_sent", "transport", "framed",
                 "buf", "loop", "ping_s", "ping_h", "t_quiet", "error_status")

    def __init__(self, engine: Engine, seq: Seq, fmt: Any, include_usage: bool,
                 error_status: int = 500) -> None:
        self.engine = engine
        self.error_status = error_status
        self.seq = seq
        self.fmt = fmt
        self.include_usage = include_usage
        self.role_sent = False
        self.transport: Any = None
        self.framed = True
        self.buf: list[bytes] | None = []  # holds writes until the headers are out
        self.loop = engine.loop
        self.ping_s = 0.0
        self.ping_h: asyncio.TimerHandle | None = None
        self.t_quiet = 0.0
        seq.on_token = self.first
        seq.on_end = self.end

    def attach(self, transport: Any, framed: bool) -> None:
        self.transport = transport
        self.framed = framed
        buf, self.buf = self.buf, None
        if buf:
            self.write(b"".join(buf))

    def write(self, data: bytes) -> None:
        if self.buf is not None:
            self.buf.append(data)
            return
        tr = self.transport
        if tr is None or tr.is_closing():
            self.engine.cancel(self.seq)  # client gone: no-op if already finished
            return
        if self.framed:
            tr.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            tr.write(data)

    def first(self, tid: int) -> None:
        self.seq.on_token = self.token
        self.write(self.fmt.first(tid, self.role_sent))

    def token(self, tid: int) -> None:
        self.write(self.fmt.token(tid))

    def opening(self, role_first: bool) -> None:
        data = self.fmt.opening(role_first)
        if data:
            self.role_sent = role_first
            self.write(data)

    def end(self, seq: Seq) -> None:
        self.stop_ping()
        o = seq.outcome
        if o in (STOP, LENGTH):
            self.write(self.fmt.finish(seq, self.include_usage))
        elif o == ERROR:
            status = self.error_status
            self.write(self.fmt.error(_error_message(seq, status), status))
        elif o == CUT and self.buf is None and self.transport is not None:
            self.transport.close()  # flushes what was written, then FIN: no terminator

    # keep-alive comments while no token flows
    def start_ping(self, interval_s: float) -> None:
        self.ping_s = interval_s
        self.t_quiet = self.loop.time()
        self.ping_h = self.loop.call_later(interval_s, self._ping)

    def _ping(self) -> None:
        seq = self.seq
        if seq.state == FINISHED:
            return
        now = self.loop.time()
        last = max(seq.t_last, self.t_quiet)
        if now - last >= self.ping_s * 0.999:
            self.write(self.fmt.ping)
            self.t_quiet = now
            nxt = now + self.ping_s
        else:
            nxt = last + self.ping_s
        self.ping_h = self.loop.call_at(nxt, self._ping)

    def stop_ping(self) -> None:
        if self.ping_h is not None:
            self.ping_h.cancel()
            self.ping_h = None


# --- handlers -----------------------------------------------------------------------------------

def _log_request(sim: SimState, request: web.Request, body: Any) -> None:
    if sim.request_log.maxlen:
        sim.request_log.append({
            "method": request.method,
            "path": request.path,
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "body": body,
            "time": time.time(),
        })


def _check_auth(cfg: SimConfig, request: web.Request, api: str = "chat") -> web.Response | None:
    """Like vllm --api-key: Bearer; Messages also takes Anthropic's `x-api-key`."""
    if not cfg.api_key:
        return None
    if request.headers.get("Authorization", "") == f"Bearer {cfg.api_key}":
        return None
    if api == "messages" and request.headers.get("x-api-key") == cfg.api_key:
        return None
    return error_response(401, "Unauthorized: missing or wrong API key", api=api)


async def _wait_forever() -> None:
    await asyncio.get_running_loop().create_future()


def _output(p: Parsed, f: Faults, ep: Endpoint, cfg: SimConfig, a: Answer) -> formats.Output:
    flavour = f.provider or ep.provider or cfg.provider
    return formats.Output(reasoning=a.reasoning, tool=p.tool, flavour=flavour,
                          per_request_metrics=cfg.per_request_metrics,
                          cache_details=flavour != "vllm" or cfg.prompt_tokens_details,
                          terminator=not f.no_terminator)


def _error_message(seq: Seq, status: int) -> str:
    """An error_after error's message: Anthropic's overload, or the engine's failure."""
    return "Overloaded" if status == 529 else seq.error_message


def _response_headers(base: str, p: Parsed, a: Answer) -> dict[str, str]:
    """X-Request-Id, and for a continued prefill the plan position it stood for (K) and whether
    it matched the plan's text exactly."""
    h = {"X-Request-Id": base}
    if p.prefill is not None:
        h["X-Sim-Prefill-Tokens"] = str(a.start)
        h["X-Sim-Prefill"] = "exact" if a.exact else "rough"
    return h


def _count_faults(sim: SimState, f: Faults, stream: bool) -> None:
    faults = sim.faults
    if f.hang == "first_token":
        faults["hang_first_token"] += 1
    if f.cut_after >= 0:
        faults["cut"] += 1
    if f.error_after >= 0:
        faults["error"] += 1
    if f.stall_ms:
        faults["stall"] += 1
    if f.token_delay_ms:
        faults["slow_tokens"] += 1
    if stream and f.linger_ms:
        faults["linger"] += 1
    if stream and f.no_terminator:
        faults["no_terminator"] += 1


async def _handle(request: web.Request, ep: Endpoint) -> web.StreamResponse:
    sim = request.app[SIM]
    engine = sim.engine
    cfg = engine.cfg
    api = ep.api
    raw = await request.read()
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    _log_request(sim, request, body if body is not None else raw.decode("utf-8", "replace"))
    sim.requests_total += 1
    if (denied := _check_auth(cfg, request, api)) is not None:
        return denied
    try:
        f = parse_faults(request.headers, sim)
        if f.status:
            sim.faults[f"status_{f.status}"] += 1
            hdrs = {"Retry-After": f.retry_after} if f.retry_after else None
            return error_response(f.status, f"Simulated error: HTTP {f.status}", headers=hdrs,
                                  api=api)
        if api == "messages" and "anthropic-version" not in request.headers:
            raise BadRequest("anthropic-version: header is required", "anthropic-version")
        if body is None:
            raise BadRequest("request body is not valid JSON")
        p = parse_body(body, api, cfg, f.continuation)
        answer = plan_answer(p, f, cfg, api)
    except BadRequest as e:
        return error_response(e.status, e.message, e.param, api=api)

    task = asyncio.current_task()
    assert task is not None
    sim.active.add(task)
    try:
        if f.hang == "headers":
            sim.faults["hang_headers"] += 1
            sim.hanging += 1
            try:
                await _wait_forever()
            except asyncio.CancelledError:
                engine.note_cancellation("queued")
                raise
            finally:
                sim.hanging -= 1
        _count_faults(sim, f, p.stream)
        seq = make_seq(p, f, cfg, engine, answer)
        out = _output(p, f, ep, cfg, answer)
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        rid = ep.id_prefix + base
        created = int(time.time())
        headers = _response_headers(base, p, answer)
        if p.stream:
            return await _stream(request, sim, seq, p, f, out, rid, created, headers, api)
        return await _unary(request, sim, seq, p, f, out, rid, created, headers, api)
    finally:
        sim.active.discard(task)


def _stream_renderer(api: str, rid: str, created: int, p: Parsed, out: formats.Output,
                     seq: Seq) -> Any:
    if api == "chat":
        return formats.OpenAIChatStream(rid, created, p.model, out)
    if api == "completions":
        return formats.OpenAICompletionStream(rid, created, p.model, out)
    if api == "responses":
        return responses_format.ResponsesStream(rid, created, p.model, out, seq)
    return anthropic_format.AnthropicStream(rid, created, p.model, out, seq)


async def _stream(request: web.Request, sim: SimState, seq: Seq, p: Parsed, f: Faults,
                  out: formats.Output, rid: str, created: int, headers: dict[str, str],
                  api: str) -> web.StreamResponse:
    engine = sim.engine
    fmt = _stream_renderer(api, rid, created, p, out, seq)
    # vLLM sends usage whenever stream_options is present, unless include_usage is false
    include_usage = bool(p.include_usage or (p.include_usage is None and out.flavour == "vllm")
                         or engine.cfg.force_include_usage)
    sink = StreamSink(engine, seq, fmt, include_usage, f.error_status)
    try:
        done = engine.submit(seq)
    except QueueFull:
        return error_response(503, "The server is overloaded: waiting queue is full.", api=api)
    resp = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE, **headers})
    try:
        writer = await resp.prepare(request)
        sink.attach(request.transport, bool(getattr(writer, "chunked", False)))
        sink.opening(f.role_first)
        if f.ping_ms:
            sink.start_ping(f.ping_ms / 1000.0)
        outcome = await done
        if outcome in (CUT, CANCELLED):
            # connection closed (by us, or the client is gone): aiohttp cancels us shortly
            if request.transport is not None:
                request.transport.close()
            await asyncio.sleep(10)
            return resp
        if f.linger_ms:  # the terminal event is out; the body stays open (proxies do this)
            await asyncio.sleep(f.linger_ms / 1000.0)
        await resp.write_eof()
        return resp
    except asyncio.CancelledError:
        engine.cancel(seq)
        raise
    except ConnectionError:
        engine.cancel(seq)
        return resp
    finally:
        sink.stop_ping()


_BODIES = {"chat": formats.chat_body, "completions": formats.completion_body,
           "responses": responses_format.response_body, "messages": anthropic_format.message_body}


async def _unary(request: web.Request, sim: SimState, seq: Seq, p: Parsed, f: Faults,
                 out: formats.Output, rid: str, created: int, headers: dict[str, str],
                 api: str) -> web.StreamResponse:
    engine = sim.engine
    try:
        done = engine.submit(seq)
    except QueueFull:
        return error_response(503, "The server is overloaded: waiting queue is full.", api=api)
    try:
        outcome = await done
    except asyncio.CancelledError:
        engine.cancel(seq)
        raise
    if outcome == CUT:
        if request.transport is not None:
            request.transport.close()
        await asyncio.sleep(10)
    if outcome == ERROR:
        return error_response(f.error_status, _error_message(seq, f.error_status), api=api)
    return web.Response(body=_BODIES[api](rid, created, p.model, seq, out), content_type=JSON,
                        headers=headers)


def _route(ep: Endpoint) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _handle(request, ep)
    return handler


async def models(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    if (denied := _check_auth(sim.cfg, request)) is not None:
        return denied
    return web.Response(body=formats.models_body(sim.cfg.served_model_names, sim.created),
                        content_type=JSON)


async def health(request: web.Request) -> web.Response:
    return web.Response()


async def metrics(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    return web.Response(body=generate_latest(sim.metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def sim_stats(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(request.app[SIM].stats()), content_type=JSON)


async def sim_requests(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(list(request.app[SIM].request_log)), content_type=JSON)


async def sim_requests_clear(request: web.Request) -> web.Response:
    request.app[SIM].request_log.clear()
    return web.Response(body=b"[]", content_type=JSON)


async def sim_config_get(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(request.app[SIM].cfg.to_dict()), content_type=JSON)


async def sim_config_post(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    try:
        changes = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return error_response(400, "body must be a JSON object of knob names to values")
    if not isinstance(changes, dict):
        return error_response(400, "body must be a JSON object of knob names to values")
    try:
        new = updated(sim.cfg, changes)
    except ValueError as e:
        return error_response(400, str(e))
    sim.set_config(new)
    return web.Response(body=orjson.dumps(new.to_dict()), content_type=JSON)


async def _on_startup(app: web.Application) -> None:
    app[SIM].engine.start()


async def _on_shutdown(app: web.Application) -> None:
    # Abort in-flight and hanging requests so graceful shutdown does not wait for them.
    for t in list(app[SIM].active):
        t.cancel()


async def _on_cleanup(app: web.Application) -> None:
    await app[SIM].engine.stop()


ROUTES = {
    "/v1/chat/completions": CHAT,
    "/openai/v1/chat/completions": GROQ_CHAT,  # the groq SDK's path
    "/v1/completions": COMPLETIONS,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
}


def build_app(cfg: SimConfig | None = None) -> web.Application:
    """A fresh simulator app with its own engine, metrics registry and request log."""
    sim = SimState(cfg if cfg is not None else SimConfig())
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[SIM] = sim
    for path, ep in ROUTES.items():
        app.router.add_post(path, _route(ep))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/stats", sim_stats)
    app.router.add_get("/sim/requests", sim_requests)
    app.router.add_delete("/sim/requests", sim_requests_clear)
    app.router.add_get("/sim/config", sim_config_get)
    app.router.add_post("/sim/config", sim_config_post)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    return app
