"""Anthropic Messages through the gateway with the official anthropic SDK: text, tool_use and
thinking streams; errors in Anthropic's shape, in-band and as HTTP responses."""
from __future__ import annotations

import anthropic
import pytest
from anthropic import AsyncAnthropic

from tests.support.provider_stack import stack

MESSAGES = [{"role": "user", "content": "What is the capital of Norway?"}]
TOOLS = [{"name": "lookup", "description": "Look something up.",
          "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}}]


def client(base: str) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=base, api_key="sk-ant-client", max_retries=0)


def anthropic_stack(**kw):
    return stack("anthropic", **kw)


async def test_text_stream_and_whole_message() -> None:
    async with anthropic_stack() as s:
        c = client(s.gw)
        async with c.messages.stream(model="m", max_tokens=6, messages=MESSAGES) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        whole = await c.messages.create(model="m", max_tokens=6, messages=MESSAGES)
        version = c.default_headers["anthropic-version"]
        await c.close()
        rec, rec_whole = await s.records(2)
        seen = (await s.sim_requests())[0]
    assert text == final.content[0].text == whole.content[0].text and text
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 6
    # The client's own API version reaches the upstream.
    assert seen["path"] == "/v1/messages" and seen["headers"]["anthropic-version"] == version
    # message_start and the ping are events but not tokens: TTFT is the first text delta.
    assert rec["route"] == "/v1/messages" and rec["outcome"] == "ok"
    assert rec["ms"]["first_event"] <= rec["ms"]["ttft"] == rec["ms"]["first_visible"]
    assert rec["events"] == 2 + 1 + 6 + 1 + 2  # start+ping, block start, deltas, stop, delta+stop
    assert rec["token_events"] == 6 and rec["completion_tokens"] == 6
    assert rec["prompt_tokens"] == final.usage.input_tokens
    assert rec["finish_reasons"] == rec_whole["finish_reasons"] == ["max_tokens"]
    assert rec_whole["completion_tokens"] == 6


async def test_tool_use_stream() -> None:
    async with anthropic_stack() as s:
        c = client(s.gw)
        async with c.messages.stream(model="m", max_tokens=64, messages=MESSAGES, tools=TOOLS,
                                     extra_headers={"x-sim-output-tokens": "5"}) as stream:
            partial = "".join([e.partial_json async for e in stream if e.type == "input_json"])
            final = await stream.get_final_message()
        await c.close()
        rec = (await s.records())[0]
    (block,) = final.content
    assert block.type == "tool_use" and block.name == "lookup" and final.stop_reason == "tool_use"
    assert isinstance(block.input["text"], str) and block.input["text"]
    assert '"text"' in partial
    # The tool_use block start is the first token, then one fragment per token and the
    # closing fragment.
    assert rec["token_events"] == 1 + 5 + 1 and rec["finish_reasons"] == ["tool_use"]
    assert "first_visible" not in rec["ms"]


async def test_thinking_deltas_come_first() -> None:
    async with anthropic_stack() as s:
        c = client(s.gw)
        async with c.messages.stream(
                model="m", max_tokens=2048, messages=MESSAGES,
                thinking={"type": "enabled", "budget_tokens": 1024},
                extra_headers={"x-sim-reasoning-tokens": "4",
                               "x-sim-output-tokens": "9"}) as stream:
            kinds = [e.type async for e in stream if e.type in ("thinking", "text", "signature")]
            final = await stream.get_final_message()
        await c.close()
        rec = (await s.records())[0]
    thinking, text = final.content
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert text.type == "text" and text.text
    assert kinds == ["thinking"] * 4 + ["signature"] + ["text"] * 5
    assert rec["ms"]["ttft"] < rec["ms"]["first_visible"] and rec["completion_tokens"] == 9


@pytest.mark.parametrize("fault,outcome,interruption", [
    ("x-sim-error-after", "upstream_error", "upstream_error"),  # the upstream's error event
    # a cut connection: the gateway ends the stream with an error event of its own
    ("x-sim-cut-after", "upstream_truncated", "upstream_connection_lost"),
])
async def test_broken_stream_raises_the_sdk_error(fault: str, outcome: str,
                                                  interruption: str) -> None:
    async with anthropic_stack() as s:
        c = client(s.gw)
        with pytest.raises(anthropic.APIStatusError) as e:
            async with c.messages.stream(model="m", max_tokens=50, messages=MESSAGES,
                                         extra_headers={fault: "3"}) as stream:
                async for _ in stream:
                    pass
        await c.close()
        rec = (await s.records())[0]
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
    assert rec["outcome"] == outcome and rec["interruption"] == interruption
    assert rec["token_events"] == 3


async def test_http_errors_are_anthropic_errors() -> None:
    async with anthropic_stack(sim={"fault_status": 529}) as s:
        c = client(s.gw)
        with pytest.raises(anthropic.NotFoundError) as missing:  # the gateway's own error
            await c.messages.create(model="nope", max_tokens=5, messages=MESSAGES)
        with pytest.raises(anthropic.BadRequestError) as bad:
            await c.messages.create(model="m", max_tokens=5, messages=MESSAGES,
                                    extra_body={"stream": "yes"})
        with pytest.raises(anthropic.InternalServerError) as overloaded:  # passed through
            await c.messages.create(model="m", max_tokens=5, messages=MESSAGES)
        await c.close()
    assert missing.value.body == {"type": "error", "error": {
        "type": "not_found_error",
        "message": "The model 'nope' does not exist or is not served by this gateway."}}
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert overloaded.value.status_code == 529
    assert overloaded.value.body["error"]["type"] == "overloaded_error"


async def test_anthropic_version_is_added_when_the_client_sends_none() -> None:
    import aiohttp

    async with anthropic_stack() as s, aiohttp.ClientSession() as http:
        async with http.post(s.gw + "/v1/messages", json={
                "model": "m", "max_tokens": 3, "messages": MESSAGES}) as r:
            assert r.status == 200, await r.text()
        async with http.post(s.gw + "/v1/messages", headers={"anthropic-version": "2099-01-01"},
                             json={"model": "m", "max_tokens": 3, "messages": MESSAGES}) as r:
            assert r.status == 200
        sent = [r["headers"]["anthropic-version"] for r in await s.sim_requests()]
    assert sent == ["2023-06-01", "2099-01-01"]


async def test_models_list_and_unknown_routes_in_anthropics_format() -> None:
    import anthropic

    from gateway import config as gw_config
    from gateway.ops.server import build_app
    from tests.support.servers import serve_app

    cfg = gw_config.parse({"auth": {"mode": "open"}, "backends": [
        {"name": "a", "type": "anthropic", "base_url": "http://127.0.0.1:9/v1",
         "models": ["claude-x"]}]}, env={})
    async with serve_app(build_app(cfg)) as gw:
        client = anthropic.AsyncAnthropic(base_url=gw, api_key="k", max_retries=0)
        models = [m.id async for m in client.models.list()]
        assert models == ["claude-x"]
        with pytest.raises(anthropic.NotFoundError) as e:
            await client.messages.count_tokens(model="claude-x",
                                               messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["type"] == "error"
        await client.close()
