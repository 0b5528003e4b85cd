"""What the observers read from each provider's stream, on the documented example streams
(wire-and-telemetry.md §1.9, §2.2, §3): which event is the first token, where usage and
finish reasons come from, what ends a stream."""
from __future__ import annotations

import orjson
from hypothesis import given, settings, strategies as st

from gateway.apis import chat, messages, responses
from gateway.apis.base import VISIBLE_TOKEN, Api, EventInfo
from gateway.apis.sse import SSEEvent, SSEParser
from gateway.exchange import Exchange
from tests.support.stamps import StampedExchange

anthropic_api, openai_responses = messages.API, responses.API


def observe(api: Api, route: str, stream: bytes,
            usage_chunks: bool = False) -> tuple[Exchange, list[int]]:
    """Feed the stream one event per read, stamping read i with time i+1; returns the exchange
    and the stamps of the token events."""
    ctx = StampedExchange(route)
    ctx.stream = True
    parser = SSEParser()
    for t, part in enumerate(stream.split(b"\n\n")[:-1], start=1):
        for ev in parser.feed(part + b"\n\n"):
            info = api.observe(ev, route)
            assert usage_chunks or not info.usage_only  # nothing here is dropped
            ctx.event_seen(info, t)
    return ctx, ctx.token_stamps


def sse(kind: str, data: str) -> bytes:
    return f"event: {kind}\ndata: {data}\n\n".encode()


ANTHROPIC_TEXT_THEN_TOOL = b"".join([
    sse("message_start", '{"type":"message_start","message":{"id":"msg_01Xq","type":"message",'
        '"role":"assistant","model":"claude-sonnet-4-5","content":[],"stop_reason":null,'
        '"stop_sequence":null,"usage":{"input_tokens":412,"cache_creation_input_tokens":0,'
        '"cache_read_input_tokens":2048,"output_tokens":1}}}'),                       # 1
    sse("content_block_start", '{"type":"content_block_start","index":0,'
        '"content_block":{"type":"text","text":""}}'),                                 # 2
    sse("ping", '{"type": "ping"}'),                                                   # 3
    sse("content_block_delta", '{"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"Checking the forecast"}}'),              # 4
    sse("content_block_stop", '{"type":"content_block_stop","index":0}'),              # 5
    sse("content_block_start", '{"type":"content_block_start","index":1,"content_block":'
        '{"type":"tool_use","id":"toolu_01Rk","name":"get_weather","input":{}}}'),     # 6
    sse("content_block_delta", '{"type":"content_block_delta","index":1,'
        '"delta":{"type":"input_json_delta","partial_json":""}}'),                     # 7
    sse("content_block_delta", '{"type":"content_block_delta","index":1,'
        '"delta":{"type":"input_json_delta","partial_json":"{\\"city\\": \\"Oslo\\"}"}}'),  # 8
    sse("content_block_stop", '{"type":"content_block_stop","index":1}'),              # 9
    sse("message_delta", '{"type":"message_delta","delta":{"stop_reason":"tool_use",'
        '"stop_sequence":null},"usage":{"output_tokens":37}}'),                        # 10
    sse("message_stop", '{"type":"message_stop"}'),                                    # 11
])


def test_anthropic_text_then_tool_use() -> None:
    ctx, tokens = observe(anthropic_api, "/v1/messages", ANTHROPIC_TEXT_THEN_TOOL)
    # text delta, tool_use block start, non-empty partial_json; not the empty fragment
    assert tokens == [4, 6, 8]
    assert ctx.t_first_event == 1 and ctx.t_first_token == ctx.t_first_visible == 4
    assert ctx.t_last_token == 8
    assert ctx.prompt_tokens == 412 + 2048  # GenAI input tokens include cache reads
    assert ctx.completion_tokens == 37 and ctx.usage_source == "upstream"
    assert ctx.finish_reasons == ["tool_use"] and ctx.done and ctx.error_type is None
    assert ctx.response_id == "msg_01Xq" and ctx.response_model == "claude-sonnet-4-5"


def test_anthropic_thinking_then_error() -> None:
    stream = b"".join([
        sse("message_start", '{"type":"message_start","message":{"id":"m","model":"c",'
            '"usage":{"input_tokens":5,"output_tokens":1}}}'),
        sse("content_block_start", '{"type":"content_block_start","index":0,'
            '"content_block":{"type":"thinking","thinking":""}}'),
        sse("content_block_delta", '{"type":"content_block_delta","index":0,"delta":'
            '{"type":"thinking_delta","thinking":"First compare the two dates"}}'),
        sse("content_block_delta", '{"type":"content_block_delta","index":0,"delta":'
            '{"type":"signature_delta","signature":"EqMBCkgI"}}'),
        sse("error", '{"type": "error", "error": {"type": "overloaded_error", '
            '"message": "Overloaded"}}'),
    ])
    ctx, tokens = observe(anthropic_api, "/v1/messages", stream)
    assert tokens == [3] and not ctx.t_first_visible  # thinking is a token, not visible text
    assert ctx.completion_tokens is None  # message_start's placeholder count is not usage
    assert ctx.done and ctx.error_type == "overloaded_error"  # an error ends the stream


RESPONSES_STREAM = b"".join([
    sse("response.created", '{"type":"response.created","sequence_number":0,"response":'
        '{"id":"resp_8f2","object":"response","status":"in_progress","model":"gpt-5.4",'
        '"output":[],"usage":null}}'),
    sse("response.output_item.added", '{"type":"response.output_item.added",'
        '"sequence_number":1,"output_index":0,"item":{"id":"fc_1","type":"function_call",'
        '"name":"f","arguments":"","call_id":"c"}}'),
    sse("response.function_call_arguments.delta", '{"type":"response.function_call_arguments'
        '.delta","sequence_number":2,"item_id":"fc_1","output_index":0,"delta":"{}"}'),
    sse("response.output_text.delta", '{"type":"response.output_text.delta",'
        '"sequence_number":3,"item_id":"msg_51","output_index":1,"content_index":0,'
        '"delta":"Hello","logprobs":[]}'),
    sse("response.completed", '{"type":"response.completed","sequence_number":4,"response":'
        '{"id":"resp_8f2","object":"response","status":"completed","model":"gpt-5.4",'
        '"output":[],"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":0},'
        '"output_tokens":5,"output_tokens_details":{"reasoning_tokens":0},'
        '"total_tokens":17}}}'),
])


def test_responses_first_token_usage_and_terminal_event() -> None:
    ctx, tokens = observe(openai_responses, "/v1/responses", RESPONSES_STREAM)
    assert tokens == [3, 4] and ctx.t_first_visible == 4
    assert (ctx.prompt_tokens, ctx.completion_tokens) == (12, 5)
    assert ctx.done and ctx.finish_reasons == ["completed"] and ctx.response_id == "resp_8f2"


def test_responses_failed_and_error_events() -> None:
    failed = RESPONSES_STREAM.split(b"event: response.completed")[0] + sse(
        "response.failed", '{"type":"response.failed","sequence_number":4,"response":{"id":'
        '"resp_8f2","status":"failed","error":{"code":"server_error","message":"boom"}}}')
    ctx, _ = observe(openai_responses, "/v1/responses", failed)
    assert ctx.done and ctx.error_type == "server_error" and not ctx.finish_reasons
    error = sse("error", '{"type":"error","code":"rate_limit_exceeded","message":"slow down",'
                '"param":null,"sequence_number":1}')
    created = RESPONSES_STREAM.split(b"\n\n")[0] + b"\n\n"
    ctx, _ = observe(openai_responses, "/v1/responses", created + error)
    assert ctx.done and ctx.error_type == "rate_limit_exceeded"


def test_groq_whole_response_stages_come_from_usage_not_x_groq() -> None:
    # Non-streamed, Groq's timings are in `usage`; `x_groq.usage` holds cache statistics.
    ctx = Exchange("/openai/v1/chat/completions")
    ctx.read_facts(chat.API.observe_response(b'{"id":"c","model":"llama","choices":[{"index":0,'
                                b'"message":{"content":"hi"},"finish_reason":"stop"}],'
                                b'"usage":{"queue_time":0.04,"prompt_tokens":25,"prompt_time":'
                                b'0.003,"completion_tokens":9,"completion_time":0.021,'
                                b'"total_time":0.024},"x_groq":{"id":"req_1","usage":'
                                b'{"dram_cached_tokens":0,"sram_cached_tokens":16}}}'))
    assert (ctx.provider_queue_s, ctx.provider_prefill_s, ctx.provider_decode_s) == (
        0.04, 0.003, 0.021)
    assert (ctx.prompt_tokens, ctx.completion_tokens) == (25, 9)


def test_error_bodies_and_stream_error_events_speak_each_format() -> None:
    assert anthropic_api.error_body(529, "Busy.") == (
        b'{"type":"error","error":{"type":"overloaded_error","message":"Busy."}}')
    assert anthropic_api.stream_error_event("Cut.", "stream_truncated", 0) == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"Cut."}}'
        b"\n\n")
    assert openai_responses.stream_error_event("Cut.", "stream_truncated", 7) == (
        b'event: error\ndata: {"type":"error","code":"stream_truncated","message":"Cut.",'
        b'"param":null,"sequence_number":7}\n\n')


# -- prompt (prefix) cache: cached tokens from every format -----------------------------------

def _whole(api: Api, body: bytes) -> Exchange:
    ctx = Exchange("/")
    ctx.read_facts(api.observe_response(body))
    return ctx


def test_cached_tokens_anthropic_stream_and_whole() -> None:
    """cache_read_input_tokens / cache_creation_input_tokens (§2.5); input = all three."""
    ctx, _ = observe(anthropic_api, "/v1/messages", ANTHROPIC_TEXT_THEN_TOOL)
    assert (ctx.prompt_tokens, ctx.cached_tokens, ctx.cache_write_tokens) == (412 + 2048, 2048, 0)
    ctx = _whole(anthropic_api, b'{"id":"msg_1","model":"c","stop_reason":"end_turn","usage":'
                 b'{"input_tokens":10,"cache_creation_input_tokens":300,'
                 b'"cache_read_input_tokens":0,"output_tokens":5}}')
    assert (ctx.prompt_tokens, ctx.cached_tokens, ctx.cache_write_tokens) == (310, 0, 300)


def test_cached_tokens_openai_chat_stream_and_whole() -> None:
    """usage.prompt_tokens_details.cached_tokens on the usage chunk (§1.5), as OpenAI, vLLM
    with --enable-prompt-tokens-details and Cerebras send it."""
    usage_chunk = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
                   b'"choices":[],"usage":{"prompt_tokens":1800,"completion_tokens":4,'
                   b'"total_tokens":1804,"prompt_tokens_details":{"cached_tokens":1536,'
                   b'"audio_tokens":0}}}\n\n')
    ctx, _ = observe(chat.API, "/v1/chat/completions", usage_chunk + b"data: [DONE]\n\n",
                     usage_chunks=True)
    assert (ctx.prompt_tokens, ctx.cached_tokens, ctx.cache_write_tokens) == (1800, 1536, None)
    ctx = _whole(chat.API, b'{"id":"c","model":"m","choices":[],"usage":{"prompt_tokens":20,'
                 b'"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}')
    assert (ctx.prompt_tokens, ctx.cached_tokens) == (20, 0)
    # vLLM without --enable-prompt-tokens-details says nothing: unknown, not a miss
    ctx = _whole(chat.API, b'{"id":"c","model":"m","choices":[],"usage":{"prompt_tokens":20,'
                 b'"completion_tokens":2,"prompt_tokens_details":null}}')
    assert (ctx.prompt_tokens, ctx.cached_tokens) == (20, None)


def test_cached_tokens_responses() -> None:
    """usage.input_tokens_details.cached_tokens of the terminal event (§1.9)."""
    completed = sse("response.completed", '{"type":"response.completed","sequence_number":9,'
                    '"response":{"id":"resp_8f2","object":"response","status":"completed",'
                    '"model":"gpt","output":[],"usage":{"input_tokens":1200,'
                    '"input_tokens_details":{"cached_tokens":1024},"output_tokens":5,'
                    '"output_tokens_details":{"reasoning_tokens":0},"total_tokens":1205}}}')
    ctx, _ = observe(openai_responses, "/v1/responses", completed)
    assert (ctx.prompt_tokens, ctx.cached_tokens) == (1200, 1024)


def test_cached_tokens_groq_stream_and_whole() -> None:
    """Streamed: x_groq.usage.prompt_tokens_details; whole: usage.prompt_tokens_details (its
    x_groq.usage there is hardware cache statistics, not prompt caching)."""
    final = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
             b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"x_groq":{"id":"r",'
             b'"usage":{"queue_time":0.04,"prompt_tokens":600,"prompt_time":0.003,'
             b'"completion_tokens":2,"completion_time":0.02,"total_time":0.023,'
             b'"prompt_tokens_details":{"cached_tokens":512}}}}\n\n')
    ctx, _ = observe(chat.API, "/v1/chat/completions", final + b"data: [DONE]\n\n")
    assert (ctx.prompt_tokens, ctx.cached_tokens) == (600, 512)
    ctx = _whole(chat.API, b'{"id":"c","model":"m","choices":[],"usage":{"queue_time":0.01,'
                 b'"prompt_tokens":600,"prompt_time":0.003,"completion_tokens":2,'
                 b'"completion_time":0.02,"total_time":0.023,"prompt_tokens_details":'
                 b'{"cached_tokens":0}},"x_groq":{"id":"r","usage":{"dram_cached_tokens":0,'
                 b'"sram_cached_tokens":16}}}')
    assert (ctx.prompt_tokens, ctx.cached_tokens) == (600, 0)


def test_cached_tokens_cerebras_and_vllm_timing() -> None:
    """Cerebras: usage.prompt_tokens_details next to time_info on the final chunk. vLLM's
    prefill is its TTFT minus its queue: inferred, and said so."""
    final = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
             b'"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":11,'
             b'"total_tokens":51,"prompt_tokens_details":{"cached_tokens":32}},"time_info":'
             b'{"queue_time":0.0004,"prompt_time":0.0021,"completion_time":0.0068,'
             b'"total_time":0.0125,"created":1767225800.41}}\n\n')
    ctx, _ = observe(chat.API, "/v1/chat/completions", final + b"data: [DONE]\n\n",
                     usage_chunks=True)
    assert (ctx.prompt_tokens, ctx.cached_tokens, ctx.provider_prefill_inferred) == (40, 32, False)
    ctx = _whole(chat.API, b'{"id":"c","model":"m","choices":[],"usage":{"prompt_tokens":40,'
                 b'"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":16}},'
                 b'"metrics":{"time_to_first_token_ms":50.0,"queue_time_ms":20.0}}')
    assert (ctx.cached_tokens, ctx.provider_queue_s) == (16, 0.02)
    assert abs(ctx.provider_prefill_s - 0.03) < 1e-9 and ctx.provider_prefill_inferred


# --------------------------------------------------------------------------------------------
# TokenShape: an event that fits a stream's token shape says what parsing it would
# --------------------------------------------------------------------------------------------

_texts = st.one_of(st.sampled_from(["", "x", " token", '"', '"error"', 'a"b', "é😀", "\\",
                                    "\n", '\\"delta\\":{\\"content\\":\\"']), st.text(max_size=8))
_delta = st.builds(lambda content, extra: {"content": content, **extra},
                   st.one_of(_texts, st.none()),
                   st.fixed_dictionaries({}, optional={
                       "role": st.just("assistant"), "reasoning_content": _texts,
                       "tool_calls": st.just([{"index": 0}])}))
_choice = st.builds(lambda index, delta, finish: {
    "index": index, "delta": delta, "logprobs": None, "finish_reason": finish},
    st.integers(0, 2), _delta, st.one_of(st.none(), st.sampled_from(["stop", "length"])))
_chunk = st.builds(lambda choices, extra: {
    "id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": choices,
    **extra},
    st.lists(_choice, max_size=2),
    st.fixed_dictionaries({}, optional={
        "usage": st.one_of(st.none(), st.just({"prompt_tokens": 3, "completion_tokens": 1})),
        "error": st.one_of(st.none(), st.just({"message": "x"})),
        "x_groq": st.just({"id": "req_1"})}))


def _observe(data: bytes) -> EventInfo:
    return chat.API.observe(SSEEvent(None, data, 0, len(data) + 8), chat.CHAT)


@settings(max_examples=400, deadline=None)
@given(_chunk, _chunk, _texts, st.booleans())
def test_an_event_that_fits_the_token_shape_says_what_parsing_says(first, other, text, same):
    """Whatever the stream's first ordinary token looked like, any later valid event that
    fits its shape is classified as parsing it would classify it: the same chunk with
    another text, or any other chunk at all."""
    data = orjson.dumps(first)
    shape = chat.API.token_shape(SSEEvent(None, data, 0, 0), chat.CHAT, _observe(data))
    if shape is None:
        return
    assert _observe(shape.prefix + b"abc" + shape.suffix) == shape.info
    if same:
        first["choices"][0]["delta"]["content"] = text
        other = first
    later = orjson.dumps(other)
    if shape.fits(later):
        assert _observe(later) == shape.info


# What a token's text may be, as bytes between the quotes: pieces of JSON escapes (whole and
# broken), quotes, control characters, UTF-8 (valid, encoded surrogates, cut), and the bytes
# of more structure (another key, another choice, a finish reason, usage).
_text_bytes = st.lists(st.one_of(
    st.sampled_from([b"\\", b'"', b'\\"', b"\\n", b"\\\\", b"\\/", b"\\u00e9", b"\\u0000",
                     b"\\ud83d\\ude00", b"\\ud83d", b"\\ude00", b"\\uD83D\\uDE00", b"\\u12",
                     b"\\x41", b"\x01", b"\x1f", b"\x7f", b"\n", b"\r", "é😀".encode(), b"\xff",
                     b"\xed\xa0\x80", "é".encode()[:1], b'","finish_reason":"stop',
                     b'"},"finish_reason":"stop"},{"index":1,"delta":{"content":"y',
                     b'"}}],"usage":{"completion_tokens":1},"x":{"a":"', b"finish_reason"]),
    st.binary(max_size=3),
    st.text(max_size=4).map(lambda t: orjson.dumps(t)[1:-1])), max_size=6).map(b"".join)


def _with_text(chunk: dict) -> dict:
    """The chunk with a plain text in its first choice: most take a shape then."""
    if chunk["choices"]:
        chunk["choices"][0]["delta"]["content"] = "tok"
    return chunk


@settings(max_examples=1000, deadline=None)
@given(_chunk.map(_with_text), _text_bytes)
def test_the_token_shapes_byte_check_is_the_parse_on_any_text(first, text):
    """Whatever bytes stand where the shape's text was — escapes, broken escapes, quotes that
    end the string and add keys or choices, control characters, invalid UTF-8 — an event that
    fits says what parsing it says; and every valid event of the same chunk with another
    non-empty text fits (the fast path misses no ordinary token)."""
    data = orjson.dumps(first)
    shape = chat.API.token_shape(SSEEvent(None, data, 0, 0), chat.CHAT, _observe(data))
    if shape is None:
        return
    later = shape.prefix + text + shape.suffix
    event = b"data: " + later + b"\n\n"
    assert shape.fits(later) == shape.fits_event(event) or b"\n" in text or b"\r" in text
    if shape.fits(later):
        assert _observe(later) == shape.info, later
    try:
        valid = isinstance(orjson.loads(b'"' + text + b'"'), str)
    except orjson.JSONDecodeError:
        valid = False
    if valid and text:
        assert shape.fits(later) and shape.fits_event(event), later


def test_token_shape_of_the_engines_chunk():
    data = (b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":" token"},"logprobs":null,'
            b'"finish_reason":null}]}')
    shape = chat.API.token_shape(SSEEvent(None, data, 0, 0), chat.CHAT, _observe(data))
    assert shape is not None and shape.info is VISIBLE_TOKEN
    assert shape.fits(data.replace(b" token", b" next"))
    for text in (b'a\\"b', b"a\\\\", b"line\\n", b"\\u00e9", b"\\ud83d\\ude00", "é😀".encode()):
        assert shape.fits(data.replace(b" token", text)), text  # one JSON string still
    for other in (data.replace(b" token", b""),  # empty text: not visible
                  data.replace(b" token", b"a\\"),  # the closing quote escaped
                  data.replace(b" token", b"\\ud83d"),  # a lone surrogate: orjson refuses it
                  data.replace(b" token", b"\\x41"),  # no such escape
                  data.replace(b" token", b"a\x01b"),  # a raw control character
                  data.replace(b" token", b"\xff"),  # not UTF-8
                  data.replace(b"null}]", b'"stop"}]'),  # the last chunk
                  data.replace(b"}]}", b'}],"usage":null}'),
                  data.replace(b'"created":1', b'"created":2'),
                  data.replace(b"finish_reason\":null", b"finish_reason\":true")):
        assert not shape.fits(other), other
    # A "text" that is really more structure: another choice, which finishes.
    other = data.replace(b" token", b'x"},"logprobs":null,"finish_reason":"stop"},'
                                    b'{"index":1,"delta":{"content":"y')
    assert _observe(other) != VISIBLE_TOKEN and not shape.fits(other)
    role = data.replace(b'{"content":" token"}', b'{"role":"assistant","content":""}')
    assert chat.API.token_shape(SSEEvent(None, role, 0, 0), chat.CHAT, _observe(role)) is None
    assert chat.API.token_shape(SSEEvent(None, data, 0, 0), chat.COMPLETIONS,
                                _observe(data)) is None


def test_no_token_shape_from_an_event_of_several_data_lines():
    """Its bytes around the text would hold a line end: a read starting with them would be
    parsed as other lines, so no shape is taken from it."""
    data = (b'{"id":"c",\n"choices":[{"index":0,"delta":{"content":" token"},'
            b'"finish_reason":null}]}')
    assert _observe(data) is VISIBLE_TOKEN
    assert chat.API.token_shape(SSEEvent(None, data, 0, 0), chat.CHAT, _observe(data)) is None


def test_token_shape_fits_a_whole_event_read():
    data = (b'{"id":"c","choices":[{"index":0,"delta":{"content":" token"},'
            b'"finish_reason":null}]}')
    shape = chat.API.token_shape(SSEEvent(None, data, 0, 0), chat.CHAT, _observe(data))
    assert shape is not None
    event = b"data: " + data.replace(b" token", b" next") + b"\n\n"
    assert shape.fits_event(event)
    for other in (event.replace(b"\n\n", b"\r\n\r\n"),  # other line ends: the parser's
                  event + event,  # two events in one read
                  event.replace(b" next", b" a\nb"),  # a raw line end in the text
                  event.replace(b" next", b" a\rb"),
                  event.replace(b" next", b""),
                  event[:-1],  # unfinished
                  event.replace(b"data: ", b"data:")):
        assert not shape.fits_event(other), other


_timing_table = st.dictionaries(
    st.sampled_from(["queue_time", "prompt_time", "completion_time", "queue_time_ms",
                     "time_to_first_token_ms", "prompt_tokens", "completion_tokens", "id"]),
    st.one_of(st.floats(-1, 10, allow_nan=False), st.integers(-1, 100), st.none()), max_size=5)
_chunk = st.dictionaries(
    st.sampled_from(["x_groq", "usage", "time_info", "metrics", "id", "model", "other"]),
    st.one_of(_timing_table, st.dictionaries(st.just("usage"), _timing_table, max_size=1),
              st.text(max_size=4), st.none()), max_size=5)


@settings(max_examples=300, deadline=None)
@given(_chunk)
def test_a_chunk_without_any_timing_key_is_read_as_if_every_reader_had_read_it(
        obj: dict[str, object]) -> None:
    """The providers' timing readers see only chunks holding one of their keys
    (Provider.timing_keys): the facts are those of giving every chunk to every reader."""
    keys = chat.TIMING_KEYS
    gated = chat._facts(obj)
    chat.TIMING_KEYS = frozenset(obj) | {"_"}  # every chunk has one
    try:
        assert chat._facts(obj) == gated
    finally:
        chat.TIMING_KEYS = keys
