"""The contract between the gateway and the modules that know a wire format.

Two kinds of module live in gateway/apis/ (Envoy AI Gateway's translator interfaces are the
model: explicit methods that return what the gateway needs, never writes into shared state):

- an `Api` — one client API family (chat + completions, Responses, Anthropic Messages): the
  routes it serves, how a request body is prepared for a backend, what one SSE event or a whole
  response says (`observe`, a pure function returning an `EventInfo`), how to answer an error
  in its format, and what identifies a prompt's shared prefix;
- a `Provider` — one backend flavour (openai, anthropic, groq, cerebras, vllm): which API family
  it speaks, how to authenticate upstream, which headers it needs by default, what it puts in
  streams unasked, and requests the gateway answers for it locally.

Only `Exchange.event_seen` / `Exchange.read_facts` turn an `EventInfo` into timeline stamps.
Adding a provider is one module here and one line in gateway/apis/__init__.py.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.apis.sse import SSEEvent
    from gateway.config import BackendConfig
    from gateway.errors import RateLimits


@dataclass(frozen=True, slots=True)
class ProviderTiming:
    """Stages the provider reported about itself, in seconds (None: not reported)."""
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    # prefill_s was computed from other reported numbers (vLLM: its TTFT minus its queue time),
    # not reported as such
    prefill_inferred: bool = False


@dataclass(slots=True)
class EventInfo:
    """What one upstream event (or a whole non-streamed response) says. Read-only by
    convention (the common answers below are shared); not frozen: a frozen dataclass's
    `__init__` sets each field through `object.__setattr__`, 3x the cost of building one,
    and a stream's role, finish and usage chunks each build one."""
    token: bool = False  # carries model output (text, tool-call names/arguments, reasoning)
    visible: bool = False  # ... and that output is user-visible text
    done: bool = False  # the protocol's terminator: nothing more is coming
    # The usage-only chunk (`choices: []`) that exists only if the gateway asked for usage: the
    # relay drops it when it did.
    usage_only: bool = False
    error_type: str | None = None  # an in-band error (bounded string)
    prompt_tokens: int | None = None  # all input tokens, cached ones included
    completion_tokens: int | None = None  # cumulative where the API counts cumulatively
    # Of prompt_tokens: read from the provider's prompt (prefix) cache, and written to it
    # (Anthropic's cache_creation_input_tokens; OpenAI's cache_write_tokens). None: the
    # provider said nothing about its cache.
    cached_tokens: int | None = None
    cache_write_tokens: int | None = None
    response_id: str | None = None
    response_model: str | None = None
    finish_reasons: tuple[str, ...] = ()
    timing: ProviderTiming | None = None
    has_facts: bool = field(default=False, init=False)  # anything beyond token/visible

    def __post_init__(self) -> None:
        self.has_facts = (self.done or self.error_type is not None
                          or self.prompt_tokens is not None
                          or self.completion_tokens is not None or self.cached_tokens is not None
                          or self.cache_write_tokens is not None or self.response_id is not None
                          or bool(self.finish_reasons) or self.timing is not None)


# The common answers, shared: observing an ordinary token allocates nothing.
NOTHING = EventInfo()
TOKEN = EventInfo(token=True)
VISIBLE_TOKEN = EventInfo(token=True, visible=True)
DONE = EventInfo(done=True)


# A byte a token text may not hold as it is: a quote or backslash (the text would not be one
# JSON string value as it stands), a control character (JSON has none raw in a string; a line
# end would end the data line). One regex search over the text: 4 bounded `bytes.find` calls
# cost twice as much (their argument parsing).
_NOT_PLAIN = re.compile(rb'["\\\x00-\x1f]').search
# A text of JSON string escapes besides plain bytes (`\n`, `\"`, `\u00e9`, a surrogate pair):
# one string value still, as orjson decodes it (a lone surrogate it refuses, so does this).
_ESCAPED = re.compile(rb'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?![dD][89a-fA-F])[0-9a-fA-F]{4}'
                      rb'|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})+').fullmatch


def _one_string(data: bytes, start: int, end: int) -> bool:
    """`data[start:end]` (non-empty) is what a JSON string holds between its quotes, as orjson
    reads it: escapes complete and valid, no raw control character, valid UTF-8 (the callers
    check plain ASCII text first, inline: most tokens are; this is the rest: text with escapes,
    a line end in the answer or a quote, checked by a second, slower regex; non-ASCII text
    decoded)."""
    bad = _NOT_PLAIN(data, start, end)
    if bad is not None and (data[bad.start()] != 92 or _ESCAPED(data, start, end) is None):
        return False
    if not data.isascii():
        try:
            data[start:end].decode()
        except UnicodeDecodeError:
            return False
    return True


@dataclass(frozen=True, slots=True)
class TokenShape:
    """A stream's ordinary text-token event as the bytes around its text. An event that is
    `prefix + text + suffix`, with a non-empty text that is the inside of one JSON string
    (`_one_string`: escapes allowed), is the event this shape was taken from with one JSON
    string value changed to another non-empty one: it says `info` too, without being parsed
    (the relay's fast path for the common token). Taken from an event of one data line:
    prefix and suffix hold no line end."""
    prefix: bytes
    suffix: bytes
    info: EventInfo
    # The whole SSE event around the text: `data: <prefix>`, `<suffix>\n\n`.
    event_prefix: bytes = field(init=False)
    event_suffix: bytes = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "event_prefix", b"data: " + self.prefix)
        object.__setattr__(self, "event_suffix", self.suffix + b"\n\n")

    def fits(self, data: bytes) -> bool:
        """`data` (one event's data) fits: the check of an event parsed out of a read."""
        start, end = len(self.prefix), len(data) - len(self.suffix)
        return (end > start and data.startswith(self.prefix) and data.endswith(self.suffix)
                and (_NOT_PLAIN(data, start, end) is None and data.isascii()
                     or _one_string(data, start, end)))

    def fits_event(self, chunk: bytes) -> bool:
        """`chunk` is exactly one whole `data:` event (LF line ends) that fits: the relay's
        check of a read, without cutting the event's data out of it. The text may then hold
        no raw line end either (the prefix and suffix hold none: they came from one data
        line)."""
        start = len(self.event_prefix)
        end = len(chunk) - len(self.event_suffix)
        return (end > start and chunk.startswith(self.event_prefix)
                and chunk.endswith(self.event_suffix)
                and (_NOT_PLAIN(chunk, start, end) is None and chunk.isascii()
                     or _one_string(chunk, start, end)))


@dataclass(frozen=True, slots=True)
class Prepared:
    """The upstream body decided by `Api.prepare`."""
    changed: bool  # the body differs from the client's: serialise it again
    usage_injected: bool = False  # the gateway asked for usage: drop the usage-only chunk


@dataclass(slots=True)
class Splice:
    """What a continuation's events are rewritten to: the answer the client has been reading
    (its id and model) and how many tokens of it came before (for the usage it reports).
    `repeat`: text the client has already that the continuation may send again at its start
    (what the prefill had to leave out); dropped once, from its first text."""
    response_id: str | None
    model: str | None
    tokens_before: int
    repeat: str = ""


class Api(ABC):
    """One client API family. Instances are stateless and shared by all requests."""

    family: str  # the API family its routes speak ("openai" or "anthropic")
    # client route -> (path under the backend's base_url, gen_ai operation name)
    routes: Mapping[str, tuple[str, str]]

    def prepare(self, body: dict[str, Any], route: str, stream: bool, backend: BackendConfig,
                provider: Provider) -> Prepared:
        """Adjust `body` (a shallow copy of the client's) for this backend in place."""
        return Prepared(changed=False)

    def choices(self, body: dict[str, Any]) -> int:
        """How many answers the request asks for: each ends with a finish reason of its own."""
        return 1

    @abstractmethod
    def observe(self, event: SSEEvent, route: str) -> EventInfo:
        """What one SSE event of a stream on `route` says. Pure: reads the event only."""

    @abstractmethod
    def observe_response(self, body: bytes) -> EventInfo:
        """What a whole (non-streamed, successful) response body says."""

    @abstractmethod
    def error_body(self, status: int, message: str, code: str | None = None,
                   param: str | None = None) -> bytes:
        """The gateway's own HTTP error, in the shape this API's SDKs read."""

    @abstractmethod
    def stream_error_event(self, message: str, code: str, events_seen: int) -> bytes:
        """An in-band error event that ends a committed stream (SDKs raise on it)."""

    def prefix_key(self, body: dict[str, Any], limit: int) -> bytes | None:
        """What identifies the prompt's shared prefix (for replica affinity), or None."""
        return None

    def token_shape(self, event: SSEEvent, route: str, info: EventInfo) -> TokenShape | None:
        """The shape of `event` (which `observe` said `info` of) for the relay to recognise
        the stream's next ordinary tokens by, or None. Only for an API whose `observe` answer
        cannot change when one non-empty string value becomes another (it reads string
        values for truthiness only, never compares them)."""
        return None

    def rate_limit_headers(self, limits: RateLimits) -> dict[str, str]:
        """A tenant's quotas in the headers this API's SDKs read (OpenAI's x-ratelimit-*
        here; Messages overrides with anthropic-ratelimit-*)."""
        out: dict[str, str] = {}
        for kind, limit, remaining, reset in (
                ("requests", limits.requests_limit, limits.requests_remaining,
                 limits.requests_reset_s),
                ("tokens", limits.tokens_limit, limits.tokens_remaining, limits.tokens_reset_s)):
            if limit:
                out[f"x-ratelimit-limit-{kind}"] = str(limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, remaining))
                out[f"x-ratelimit-reset-{kind}"] = _duration(reset)
        return out

    def output_text(self, event: SSEEvent) -> str | None:
        """The model text in one event, for opt-in content capture only (never on the hot
        path unless the operator asked for it)."""
        return None

    # -- mid-stream continuation (an API that can, overrides these) ----------------------------
    continues = False

    def continuation_text(self, event: SSEEvent) -> tuple[str, str | None] | None:
        """The text a token event adds to an answer that a prefill could continue, and the
        answer's id the event names; None when it adds something a prefill cannot carry on
        (reasoning, a tool call, several choices)."""
        return None

    def continuation_body(self, body: dict[str, Any], route: str, text: str,
                          tokens: int) -> dict[str, Any] | None:
        """The request that continues an answer cut after `text` (`tokens` tokens of it): the
        same request with that text as the assistant's to continue, and a token limit reduced
        by what was sent. None where it cannot be continued."""
        return None

    def continuation_repeat(self, text: str) -> str:
        """What of `text` the continuation's prefill leaves out (and so may send again)."""
        return ""

    def splice_event(self, event: SSEEvent, splice: Splice) -> bytes | None:
        """One event of a continuation as the client's stream goes on with it: the answer's
        own id and model, no second opening, usage that counts what the client received.
        None: the event is dropped."""
        return None


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]
# A provider's own timing fields in a usage chunk or a whole response: its timing and the
# table holding the token counts next to it (None: the chunk has no such fields).
TimingReader = Callable[[dict[str, Any]], "tuple[ProviderTiming, Any] | None"]


@dataclass(frozen=True)
class Provider:
    """One backend flavour."""
    name: str
    family: str  # the API family it speaks
    auth_header: str = "Authorization"  # where its key goes ("Authorization" gets "Bearer ")
    default_headers: Mapping[str, str] = field(default_factory=dict)  # unless the client sent
    usage_in_every_stream: bool = False  # streams carry usage unasked: never inject or strip
    # The server sends usage whenever `stream_options` is present unless include_usage is
    # false (vLLM's StreamOptions default).
    usage_when_stream_options: bool = False
    # client route -> the route it mirrors (served exactly like it; e.g. Groq's /openai/v1/...)
    mirrored_routes: Mapping[str, str] = field(default_factory=dict)
    # path -> (method, handler): requests the gateway answers itself for this provider's SDK
    local_routes: Mapping[str, tuple[str, Handler]] = field(default_factory=dict)
    # the timings it reports in its streams (Groq x_groq, Cerebras time_info, vLLM metrics)
    timing: TimingReader | None = None
    # the top-level keys `timing` reads: a chunk with none of them is not given to it
    timing_keys: tuple[str, ...] = ()

    def auth_headers(self, api_key: str) -> dict[str, str]:
        if self.auth_header.lower() == "authorization":
            return {"Authorization": f"Bearer {api_key}"}
        return {self.auth_header: api_key}


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "1m30.5s"."""
    seconds = max(0.0, seconds)
    minutes, rest = divmod(seconds, 60.0)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def bounded(value: Any, limit: int = 64) -> str:
    """An upstream-chosen string as a bounded label value."""
    return str(value)[:limit]


def seconds(value: Any) -> float | None:
    """A non-negative number of seconds, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def count(value: Any) -> int | None:
    """A non-negative token count, or None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def cache_details(details: Any) -> tuple[int | None, int | None]:
    """(cached, written) tokens of an OpenAI-style `prompt_tokens_details` /
    `input_tokens_details` object (OpenAI, Responses, vLLM with
    --enable-prompt-tokens-details, Groq, Cerebras)."""
    if not isinstance(details, dict):
        return None, None
    return count(details.get("cached_tokens")), count(details.get("cache_write_tokens"))


def json_object(data: bytes) -> dict[str, Any] | None:
    """The JSON object in `data`, or None for anything else (not ours to judge: the client
    decides what to do with it)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None
