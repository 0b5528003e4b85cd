"""OpenAI formats through the gateway with the official openai SDK: chat (reasoning, tool-call
streaming), completions, Responses; vLLM specifics; the max_completion_tokens rename."""
from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from gateway.apis import chat, provider_for
from gateway.config import BackendConfig
from tests.support.provider_stack import stack

MESSAGES = [{"role": "user", "content": "Which river runs through the old city?"}]
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look something up.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]


def client(base: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base + "/v1", api_key="sk-client", max_retries=0)


async def test_chat_stream_with_reasoning_then_text() -> None:
    async with stack() as s:
        c = client(s.gw)
        stream = await c.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
            extra_headers={"x-sim-reasoning-tokens": "3", "x-sim-output-tokens": "8"})
        reasoning, text, usage = [], [], None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                reasoning.append(getattr(choice.delta, "reasoning", None) or "")
                text.append(choice.delta.content or "")
        whole = await c.chat.completions.create(
            model="m", messages=MESSAGES, extra_headers={"x-sim-reasoning-tokens": "3",
                                                        "x-sim-output-tokens": "8"})
        await c.close()
        (rec, _) = await s.records(2)
    message = whole.choices[0].message
    assert "".join(reasoning) == message.model_extra["reasoning"] and "".join(reasoning)
    assert "".join(text) == message.content and len(message.content.split()) >= 4
    assert usage.completion_tokens == 8
    assert usage.completion_tokens_details.reasoning_tokens == 3
    # The first reasoning delta is the first token; the text comes three tokens later.
    assert rec["ms"]["ttft"] < rec["ms"]["first_visible"]
    assert rec["token_events"] == 8 and rec["completion_tokens"] == 8
    assert rec["outcome"] == "ok" and rec["finish_reasons"] == ["stop"]


async def test_chat_tool_call_streams_as_fragments() -> None:
    async with stack() as s:
        c = client(s.gw)
        stream = await c.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, stream=True,
            extra_headers={"x-sim-output-tokens": "6"})
        name, arguments, fragments, finish = None, "", 0, None
        async for chunk in stream:
            choice = chunk.choices[0]
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                name = call.function.name or name
                if call.function.arguments:
                    arguments += call.function.arguments
                    fragments += 1
            finish = choice.finish_reason or finish
        whole = await c.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                                extra_headers={"x-sim-output-tokens": "6"})
        await c.close()
        rec = (await s.records(2))[0]
    call = whole.choices[0].message.tool_calls[0]
    assert name == call.function.name == "lookup" and finish == "tool_calls"
    assert arguments == call.function.arguments
    assert json.loads(arguments)["text"]  # the fragments join into valid JSON
    assert fragments == 7  # one per token, plus the closing fragment
    # The name chunk counts as the first token; usage came from the upstream although the
    # client did not ask for it (the gateway asked and dropped the extra chunk).
    assert rec["token_events"] == 8 and rec["completion_tokens"] == 6
    assert rec["usage_source"] == "upstream"


async def test_completions_stream_and_whole() -> None:
    async with stack() as s:
        c = client(s.gw)
        stream = await c.completions.create(model="m", prompt="Once upon a time", max_tokens=5,
                                            stream=True)
        streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        whole = await c.completions.create(model="m", prompt="Once upon a time", max_tokens=5)
        await c.close()
        recs = await s.records(2)
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 5
    assert [r["completion_tokens"] for r in recs] == [5, 5]


async def test_responses_stream_helper_and_whole() -> None:
    async with stack() as s:
        c = client(s.gw)
        headers = {"x-sim-reasoning-tokens": "2", "x-sim-output-tokens": "7"}
        async with c.responses.stream(model="m", input="Tell me about rivers.",
                                      extra_headers=headers) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        whole = await c.responses.create(model="m", input="Tell me about rivers.",
                                         extra_headers=headers)
        await c.close()
        rec = (await s.records(2))[0]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.reasoning_text.delta") == 2
    assert kinds.count("response.output_text.delta") == 5
    assert final.output_text == whole.output_text and final.output_text
    assert final.usage.output_tokens == 7
    assert final.usage.output_tokens_details.reasoning_tokens == 2
    assert rec["route"] == "/v1/responses" and rec["outcome"] == "ok"
    assert rec["completion_tokens"] == 7 and rec["prompt_tokens"] == final.usage.input_tokens
    assert rec["token_events"] == 7 and rec["ms"]["ttft"] < rec["ms"]["first_visible"]
    assert rec["finish_reasons"] == ["completed"]


async def test_responses_function_call() -> None:
    tools = [{"type": "function", "name": "lookup",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    async with stack() as s:
        c = client(s.gw)
        async with c.responses.stream(model="m", input="Look it up.", tools=tools,
                                      extra_headers={"x-sim-output-tokens": "4"}) as stream:
            deltas = [e.delta async for e in stream
                      if e.type == "response.function_call_arguments.delta"]
            final = await stream.get_final_response()
        await c.close()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "lookup"
    assert "".join(deltas) == call.arguments and json.loads(call.arguments)["text"]


async def test_responses_upstream_error_and_gateway_error_events() -> None:
    async with stack(server={"access_log": True, "commit": "headers"}) as s:
        c = client(s.gw)
        stream = await c.responses.create(model="m", input="x", stream=True,
                                          extra_headers={"x-sim-error-after": "2"})
        kinds = [event.type async for event in stream]
        assert kinds[-2:] == ["error", "response.failed"]
        # A stream the upstream cuts is ended by the gateway with an error event in the
        # Responses format, numbered after the last upstream event.
        async with aiohttp.ClientSession() as http, http.post(
                s.gw + "/v1/responses", headers={"x-sim-cut-after": "2"},
                json={"model": "m", "input": "x", "stream": True}) as r:
            events = (await r.read()).decode().strip().split("\n\n")
        await c.close()
        recs = await s.records(2)
    assert recs[0]["outcome"] == "upstream_error" and recs[0]["error_type"] == "server_error"
    name, data = events[-1].split("\n")
    error = json.loads(data.removeprefix("data: "))
    assert name == "event: error" and error["type"] == "error"
    assert error["code"] == "stream_truncated" and error["message"]
    last = json.loads(events[-2].split("\n")[1].removeprefix("data: "))
    # The number is written only when the relay passes the context to stream_error_event.
    assert error.get("sequence_number", last["sequence_number"] + 1) == last["sequence_number"] + 1
    assert recs[1]["outcome"] == "upstream_truncated"


async def test_vllm_per_request_metrics_become_provider_stages() -> None:
    async with stack(sim={"per_request_metrics": True, "max_batch": 1},
                     backend={"provider": "vllm"}) as s:
        c = client(s.gw)
        stream = await c.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, max_tokens=4,
            stream_options={"include_usage": True})
        metrics = [chunk.model_extra.get("metrics") async for chunk in stream]
        await c.close()
        rec = (await s.records())[0]
    reported = metrics[-1]
    assert reported and all(m is None for m in metrics[:-1])
    assert rec["ms"]["provider_queue"] == pytest.approx(reported["queue_time_ms"], abs=1e-3)
    assert rec["ms"]["provider_prefill"] == pytest.approx(
        reported["time_to_first_token_ms"] - reported["queue_time_ms"], abs=2e-3)


# -- request preparation per backend ---------------------------------------------------------------

def _backend(**kwargs: Any) -> BackendConfig:
    return BackendConfig(name="b", base_url="http://127.0.0.1:1/v1", **kwargs)


def _prepare(body: dict, backend=None, stream: bool = True) -> tuple[bool, dict, bool]:
    provider = provider_for(backend.type, backend.provider) if backend else provider_for("openai")
    prepared = chat.API.prepare(body, chat.CHAT, stream, backend or _backend(type="openai"),
                                provider)
    return prepared.changed, body, prepared.usage_injected


def test_usage_injection_depends_on_what_the_backend_sends_unasked() -> None:
    openai_like = _backend(type="openai", provider="openai")
    vllm = _backend(type="openai", provider="vllm")
    groq = _backend(type="groq", provider="groq")
    cerebras = _backend(type="cerebras", provider="cerebras")
    for backend in (None, openai_like, vllm):
        assert _prepare({}, backend) == (True, {"stream_options": {"include_usage": True}}, True)
    # stream_options without include_usage: vLLM sends usage anyway, OpenAI does not.
    assert _prepare({"stream_options": {}}, vllm) == (False, {"stream_options": {}}, False)
    assert _prepare({"stream_options": {}}, openai_like)[2] is True
    assert _prepare({"stream_options": {"include_usage": False}}, vllm)[2] is True
    # Groq and Cerebras put usage in every stream: nothing to ask, nothing to strip.
    for backend in (groq, cerebras):
        assert _prepare({}, backend) == (False, {}, False)
    assert _prepare({}, openai_like, stream=False) == (False, {}, False)


def test_max_completion_tokens_renamed_only_where_configured() -> None:
    llamacpp = _backend(type="openai", provider="llamacpp",
                               rename_max_completion_tokens=True)
    other = _backend(type="openai", provider="openai")
    assert _prepare({"max_completion_tokens": 9}, llamacpp, stream=False) == (
        True, {"max_tokens": 9}, False)
    assert _prepare({"max_completion_tokens": 9, "max_tokens": 5}, llamacpp, stream=False)[1] == {
        "max_tokens": 5}
    assert _prepare({"max_completion_tokens": 9}, other, stream=False) == (
        False, {"max_completion_tokens": 9}, False)




async def test_max_completion_tokens_reaches_a_llamacpp_backend_as_max_tokens() -> None:
    async with stack(backend={"provider": "llamacpp", "rename_max_completion_tokens": True}) as s:
        c = client(s.gw)
        await c.chat.completions.create(model="m", messages=MESSAGES, max_completion_tokens=3)
        await c.close()
        sent = (await s.sim_requests())[-1]["body"]
    assert sent["max_tokens"] == 3 and "max_completion_tokens" not in sent


async def test_vllm_stream_options_without_include_usage_keep_their_usage_chunk() -> None:
    async with stack(backend={"provider": "vllm"}) as s:
        c = client(s.gw)
        stream = await c.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                 max_tokens=3, stream_options={})
        usage = [chunk.usage async for chunk in stream if not chunk.choices]
        await c.close()
    assert usage and usage[0].completion_tokens == 3  # what vLLM sends to a direct client


async def test_unknown_model_is_an_openai_error_on_every_openai_route() -> None:
    async with stack() as s:
        c = client(s.gw)
        with pytest.raises(openai.NotFoundError) as chat:
            await c.chat.completions.create(model="nope", messages=MESSAGES)
        with pytest.raises(openai.NotFoundError) as responses:
            await c.responses.create(model="nope", input="x")
        await c.close()
    for e in (chat.value, responses.value):
        assert e.body["code"] == "model_not_found" and e.body["type"] == "not_found_error"
