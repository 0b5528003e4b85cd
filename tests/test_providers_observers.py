"""What the observers read from each provider's stream, on the documented example streams
(wire-and-telemetry.md §1.9, §2.2, §3): which event is the first token, where usage and
finish reasons come from, what ends a stream."""
from __future__ import annotations

from backends import anthropic as anthropic_api, openai as openai_api, openai_responses
from gateway.context import RequestContext
from gateway.sse import SSEParser


def observe(api, route: str, stream: bytes) -> tuple[RequestContext, list[int]]:
    """Feed the stream one event per read, stamping read i with time i+1; returns the context
    and the stamps of the token events."""
    ctx = RequestContext(route)
    ctx.stream = True
    observer = api.StreamObserver(ctx)
    parser = SSEParser()
    for t, part in enumerate(stream.split(b"\n\n")[:-1], start=1):
        for ev in parser.feed(part + b"\n\n"):
            assert observer.on_event(ev, t)
    return ctx, ctx.token_ns


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
    ctx = RequestContext("/openai/v1/chat/completions")
    openai_api.observe_response(ctx, b'{"id":"c","model":"llama","choices":[{"index":0,'
                                b'"message":{"content":"hi"},"finish_reason":"stop"}],'
                                b'"usage":{"queue_time":0.04,"prompt_tokens":25,"prompt_time":'
                                b'0.003,"completion_tokens":9,"completion_time":0.021,'
                                b'"total_time":0.024},"x_groq":{"id":"req_1","usage":'
                                b'{"dram_cached_tokens":0,"sram_cached_tokens":16}}}')
    assert (ctx.provider_queue_s, ctx.provider_prefill_s, ctx.provider_decode_s) == (
        0.04, 0.003, 0.021)
    assert (ctx.prompt_tokens, ctx.completion_tokens) == (25, 9)


def test_error_bodies_and_stream_error_events_speak_each_format() -> None:
    assert anthropic_api.error_body(529, "Busy.") == (
        b'{"type":"error","error":{"type":"overloaded_error","message":"Busy."}}')
    assert anthropic_api.stream_error_event("Cut.", "stream_truncated") == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"Cut."}}'
        b"\n\n")
    ctx = RequestContext("/v1/responses")
    ctx.events = 7
    assert openai_responses.stream_error_event("Cut.", "stream_truncated", ctx) == (
        b'event: error\ndata: {"type":"error","code":"stream_truncated","message":"Cut.",'
        b'"param":null,"sequence_number":7}\n\n')
