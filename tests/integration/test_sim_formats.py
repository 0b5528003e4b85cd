"""The simulator's provider formats, spoken directly (no gateway): one engine behind every
format, each format's request rules and errors, the provider flavours' usage rules, and the
fault that fails only the first requests."""
from __future__ import annotations

import aiohttp
import anthropic
import openai
import orjson
import pytest

from backends.sim import SimConfig, build_app
from tests.support.servers import serve_app

FAST = dict(decode_base_ms=1.0, decode_per_seq_ms=0.0, prefill_tokens_per_s=1e9)
PROMPT = "Tell me about the river."
VERSION = {"anthropic-version": "2023-06-01"}


async def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.read()


def events(raw: bytes) -> list[dict]:
    return [orjson.loads(line[6:]) for line in raw.split(b"\n")
            if line.startswith(b"data: {")]


async def test_one_engine_behind_every_format() -> None:
    """The same prompt gives the same answer in all four formats (the engine decides the
    tokens; the formats only write them)."""
    async with serve_app(build_app(SimConfig(**FAST))) as url:
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k")
        an = anthropic.AsyncAnthropic(base_url=url, api_key="k")
        msgs = [{"role": "user", "content": PROMPT}]
        chat = await oa.chat.completions.create(model="m", messages=msgs, max_tokens=7)
        groq_path = await oa.with_options(base_url=url + "/openai/v1").chat.completions.create(
            model="m", messages=msgs, max_tokens=7)
        resp = await oa.responses.create(model="m", input=PROMPT, max_output_tokens=7)
        message = await an.messages.create(model="m", messages=msgs, max_tokens=7)
        await oa.close()
        await an.close()
    text = chat.choices[0].message.content
    assert text and len(text.split()) >= 3
    assert (groq_path.choices[0].message.content == resp.output_text == message.content[0].text
            == text)
    assert groq_path.x_groq["id"]  # /openai/v1 answers in the Groq flavour


async def test_anthropic_request_rules_and_error_shape() -> None:
    async with serve_app(build_app(SimConfig(**FAST, api_key="sk-up"))) as url:
        body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
        no_version = await post(url + "/v1/messages", body, {"x-api-key": "sk-up"})
        no_max = await post(url + "/v1/messages", {**body, "max_tokens": None},
                            {"x-api-key": "sk-up", **VERSION})
        wrong_key = await post(url + "/v1/messages", body, {"x-api-key": "nope", **VERSION})
        bearer = await post(url + "/v1/messages", body,
                            {"Authorization": "Bearer sk-up", **VERSION})
    assert no_version[0] == 400 and orjson.loads(no_version[1]) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "anthropic-version: header is required"}}
    assert no_max[0] == 400 and b"max_tokens" in no_max[1]
    assert wrong_key[0] == 401
    assert orjson.loads(wrong_key[1])["error"]["type"] == "authentication_error"
    assert bearer[0] == 200 and orjson.loads(bearer[1])["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("provider,options,usage_chunk", [
    ("vllm", {}, True),  # vLLM: stream_options present means usage unless switched off
    ("vllm", {"include_usage": False}, False),
    ("groq", {}, False),  # OpenAI semantics
    ("cerebras", {"include_usage": False}, True),  # Cerebras streams usage unasked
])
async def test_usage_chunk_rules_per_provider(provider: str, options: dict,
                                              usage_chunk: bool) -> None:
    async with serve_app(build_app(SimConfig(**FAST))) as url:
        status, raw = await post(url + "/v1/chat/completions", {
            "model": "m", "stream": True, "max_tokens": 2, "stream_options": options,
            "messages": [{"role": "user", "content": "x"}]}, {"x-sim-provider": provider})
    assert status == 200
    usage = [e for e in events(raw) if e.get("usage")]
    assert bool(usage) == usage_chunk
    if usage_chunk:
        assert usage[0]["choices"] == [] and usage[0]["usage"]["completion_tokens"] == 2
        assert ("time_info" in usage[0]) == (provider == "cerebras")


async def test_fault_status_count_fails_only_the_first_requests() -> None:
    cfg = SimConfig(**FAST, fault_status=429, fault_status_count=2, retry_after_s=1.5)
    async with serve_app(build_app(cfg)) as url:
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        results = [await post(url + "/v1/chat/completions", body) for _ in range(3)]
        anthropic_429 = None
        async with aiohttp.ClientSession() as s:
            await s.post(url + "/sim/config", json={"fault_status_count": 3})
            async with s.post(url + "/v1/messages", json=body, headers=VERSION) as r:
                anthropic_429 = (r.status, r.headers.get("Retry-After"), await r.json())
    assert [status for status, _ in results] == [429, 429, 200]
    assert anthropic_429 == (429, "1.5", {"type": "error", "error": {
        "type": "rate_limit_error", "message": "Simulated error: HTTP 429"}})


async def test_bad_provider_header_is_a_400() -> None:
    async with serve_app(build_app(SimConfig(**FAST))) as url:
        status, raw = await post(url + "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": "x"}]},
            {"x-sim-provider": "mystery"})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "x-sim-provider"
