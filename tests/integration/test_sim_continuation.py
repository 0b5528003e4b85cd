"""The simulator continues an assistant prefill the way vLLM (chat `continue_final_message`) and
Anthropic (a final assistant message) do, over real loopback sockets. The key property: the
continuation is byte for byte the rest of the answer the same request gives unbroken, so a
gateway that resumes a cut stream can be tested for exactness."""
from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from backends.sim import SimConfig, build_app
from tests.support.servers import serve_app

FAST = dict(decode_base_ms=1.0, decode_per_seq_ms=0.0, prefill_tokens_per_s=1e9)
VERSION = {"anthropic-version": "2023-06-01"}
USER = [{"role": "user", "content": "Tell me about rivers."}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


async def post(url: str, path: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def data(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


class Chat:
    """One chat answer, streamed: its content tokens, reasoning tokens, finish and usage."""

    def __init__(self, raw: bytes) -> None:
        evs = data(raw)
        deltas = [e["choices"][0]["delta"] for e in evs if e.get("choices")]
        self.tokens = [d["content"] for d in deltas if d.get("content")]
        self.reasoning = [d["reasoning"] for d in deltas if d.get("reasoning")]
        self.roles = [d["role"] for d in deltas if "role" in d]
        self.finish = [e["choices"][0]["finish_reason"] for e in evs
                       if e.get("choices") and e["choices"][0]["finish_reason"]]
        self.usage = next(e["usage"] for e in evs if e.get("usage"))
        self.text = "".join(self.tokens)
        self.done = raw.endswith(b"data: [DONE]\n\n")


async def chat(url: str, messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
               **kw: Any) -> Chat:
    status, _, raw = await post(url, "/v1/chat/completions", {
        "model": "m", "messages": messages, "stream": True,
        "stream_options": {"include_usage": True}, **kw}, headers)
    assert status == 200, raw
    return Chat(raw)


def prefill(text: str, **extra: Any) -> list[dict[str, Any]]:
    return [*USER, {"role": "assistant", "content": text, **extra}]


@pytest.fixture
async def url() -> Any:
    async with serve_app(build_app(SimConfig(**FAST))) as u:
        yield u


async def test_chat_continuation_is_the_rest_of_the_unbroken_answer(url: str) -> None:
    whole = await chat(url, USER)
    n = len(whole.tokens)
    assert whole.finish == ["stop"] and n == whole.usage["completion_tokens"] > 6
    for k in (1, 2, 5, n - 1):
        head = "".join(whole.tokens[:k])
        rest = await chat(url, prefill(head), **CONTINUE)
        assert head + rest.text == whole.text, k
        assert rest.tokens == whole.tokens[k:]  # one event per token, as unbroken
        assert rest.finish == ["stop"] and rest.done
        # vLLM counts the prefill in the prompt and only new tokens in the completion
        assert rest.usage["completion_tokens"] == n - k
        assert rest.usage["prompt_tokens"] == whole.usage["prompt_tokens"] + k
        assert rest.usage["total_tokens"] == whole.usage["total_tokens"]
    status, _, raw = await post(url, "/v1/chat/completions", {
        "model": "m", "messages": prefill("".join(whole.tokens[:3])), **CONTINUE})
    answer = orjson.loads(raw)
    assert status == 200 and answer["choices"][0]["message"]["content"] == "".join(
        whole.tokens[3:])


async def test_chat_continuation_under_max_tokens_ends_where_the_answer_would(url: str) -> None:
    whole = await chat(url, USER, max_tokens=12)
    assert whole.finish == ["length"] and len(whole.tokens) == 12
    rest = await chat(url, prefill("".join(whole.tokens[:4])), max_tokens=8, **CONTINUE)
    assert "".join(whole.tokens[:4]) + rest.text == whole.text
    assert rest.finish == ["length"] and rest.usage["completion_tokens"] == 8
    # the same seed request gives the same plan, whatever the prompt
    seeded = await chat(url, [{"role": "user", "content": "other"}], seed=7, max_tokens=6)
    again = await chat(url, [{"role": "user", "content": "other"},
                             {"role": "assistant", "content": seeded.tokens[0]}],
                       seed=7, max_tokens=5, **CONTINUE)
    assert seeded.tokens[0] + again.text == seeded.text


async def test_a_prefill_that_is_the_whole_answer_gets_an_empty_answer(url: str) -> None:
    whole = await chat(url, USER)
    rest = await chat(url, prefill(whole.text), **CONTINUE)
    assert rest.tokens == [] and rest.roles == ["assistant"] and rest.finish == ["stop"]
    assert rest.usage["completion_tokens"] == 0 and rest.done
    # Messages always has max_tokens, which the answer runs to unless its length is forced
    forced = {"x-sim-output-tokens": "10", **VERSION}
    status, _, raw = await post(url, "/v1/messages", {
        "model": "m", "max_tokens": 50, "messages": USER}, forced)
    text = orjson.loads(raw)["content"][0]["text"]
    assert text == text.rstrip()  # else Anthropic's whitespace rule refuses it as a prefill
    status, _, raw = await post(url, "/v1/messages", {
        "model": "m", "max_tokens": 50,
        "messages": [*USER, {"role": "assistant", "content": text}]}, forced)
    msg = orjson.loads(raw)
    assert status == 200 and msg["content"] == [] and msg["usage"]["output_tokens"] == 0
    assert msg["stop_reason"] == "end_turn"


async def test_reasoning_prefills(url: str) -> None:
    """A prefill of content means the reasoning is over: only content follows. A prefill of
    reasoning alone (chat `reasoning`) continues the reasoning."""
    hdr = {"x-sim-reasoning-tokens": "6"}
    whole = await chat(url, USER, hdr, max_tokens=14)
    assert len(whole.reasoning) == 6 and len(whole.tokens) == 8
    rest = await chat(url, prefill("".join(whole.tokens[:3])), hdr, max_tokens=5, **CONTINUE)
    assert rest.reasoning == [] and rest.tokens == whole.tokens[3:]
    assert "completion_tokens_details" not in rest.usage or (
        rest.usage["completion_tokens_details"]["reasoning_tokens"] == 0)
    thinking = prefill("", reasoning="".join(whole.reasoning[:2]))
    more = await chat(url, thinking, hdr, max_tokens=12, **CONTINUE)
    assert more.reasoning == whole.reasoning[2:] and more.tokens == whole.tokens
    assert more.usage["completion_tokens_details"]["reasoning_tokens"] == 4


async def test_someone_elses_prefill_or_a_cut_token_is_continued_roughly(url: str) -> None:
    whole = await chat(url, USER)
    cut_word = "".join(whole.tokens[:3]) + whole.tokens[3][:2]  # mid-token
    for text in ("Hello there, friend", cut_word):
        status, headers, raw = await post(url, "/v1/chat/completions", {
            "model": "m", "messages": prefill(text), "stream": True, **CONTINUE})
        assert status == 200 and headers["X-Sim-Prefill"] == "rough"
        evs = data(raw)
        assert raw.endswith(b"data: [DONE]\n\n") and evs[-1]["choices"][0]["finish_reason"]
    status, headers, _ = await post(url, "/v1/chat/completions", {
        "model": "m", "messages": prefill("".join(whole.tokens[:4])), **CONTINUE})
    assert headers["X-Sim-Prefill"] == "exact" and headers["X-Sim-Prefill-Tokens"] == "4"


async def test_chat_prefill_rules(url: str) -> None:
    body = {"model": "m", "messages": prefill("x")}
    both = await post(url, "/v1/chat/completions", {**body, "continue_final_message": True,
                                                    "add_generation_prompt": True})
    default = await post(url, "/v1/chat/completions", {**body, "continue_final_message": True})
    refused = await post(url, "/v1/chat/completions", {**body, **CONTINUE},
                         {"x-sim-continuation": "0"})
    plain = await post(url, "/v1/chat/completions", body)  # no flag: a new assistant turn
    assert both[0] == default[0] == refused[0] == 400
    assert orjson.loads(both[2])["error"]["message"] == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    assert "are not compatible" in orjson.loads(default[2])["error"]["message"]
    assert orjson.loads(refused[2])["error"]["param"] == "continue_final_message"
    assert plain[0] == 200 and "X-Sim-Prefill" not in plain[1]
    tools = [{"type": "function", "function": {"name": "look", "parameters": {}}}]
    tool = await post(url, "/v1/chat/completions", {**body, **CONTINUE, "tools": tools})
    answer = orjson.loads(tool[2])["choices"][0]  # a tool call starts over
    assert tool[1]["X-Sim-Prefill"] == "rough" and answer["finish_reason"] == "tool_calls"


def message_text(raw: bytes) -> tuple[list[str], list[str]]:
    """(text deltas, event types) of a Messages stream."""
    evs = data(raw)
    return ([e["delta"]["text"] for e in evs if e["type"] == "content_block_delta"
             and e["delta"]["type"] == "text_delta"], [e["type"] for e in evs])


async def messages(url: str, msgs: list[dict[str, Any]], **kw: Any) -> tuple[list[str], bytes]:
    status, _, raw = await post(url, "/v1/messages", {
        "model": "m", "max_tokens": 30, "stream": True, "messages": msgs, **kw}, VERSION)
    assert status == 200, raw
    return message_text(raw)[0], raw


async def test_messages_prefill_is_continued(url: str) -> None:
    whole, _ = await messages(url, USER)
    for k in (1, 7, 29):
        head = "".join(whole[:k])
        rest, raw = await messages(url, [*USER, {"role": "assistant", "content": head}],
                                   max_tokens=30 - k)
        assert head + "".join(rest) == "".join(whole), k
        delta = next(e for e in data(raw) if e["type"] == "message_delta")
        assert delta["usage"]["output_tokens"] == 30 - k
        assert delta["delta"]["stop_reason"] == "max_tokens"
    blocks = [{"type": "text", "text": "".join(whole[:2])}, {"type": "text", "text": whole[2]}]
    rest, _ = await messages(url, [*USER, {"role": "assistant", "content": blocks}],
                             max_tokens=27)
    assert rest == whole[3:]


async def test_messages_prefill_with_trailing_whitespace_stripped_stays_exact(url: str) -> None:
    """Anthropic refuses a prefill ending in whitespace; the only tokens that end in whitespace
    are whole newline tokens, so a gateway that strips them still continues exactly."""
    for seed in range(60):
        whole, _ = await messages(url, USER, max_tokens=40, seed=seed)
        k = next((i for i, t in enumerate(whole[1:-1], 1) if not t.strip()), 0)
        if k and whole[k - 1].strip():
            break  # token k is a newline after a word
    else:
        pytest.fail("no answer with a newline token")
    head = "".join(whole[:k + 1])
    status, _, raw = await post(url, "/v1/messages", {
        "model": "m", "max_tokens": 39 - k, "seed": seed,
        "messages": [*USER, {"role": "assistant", "content": head}]}, VERSION)
    assert status == 400 and orjson.loads(raw) == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "final assistant content cannot end with trailing whitespace"}}
    stripped = head.rstrip()
    assert stripped == "".join(whole[:k])  # the newline token is gone, and comes again
    rest, _ = await messages(url, [*USER, {"role": "assistant", "content": stripped}],
                             max_tokens=40 - k, seed=seed)
    assert stripped + "".join(rest) == "".join(whole)


async def test_messages_prefill_refused_without_support() -> None:
    async with serve_app(build_app(SimConfig(**FAST, continuation=False))) as url:
        status, _, raw = await post(url, "/v1/messages", {
            "model": "m", "max_tokens": 5,
            "messages": [*USER, {"role": "assistant", "content": "The"}]}, VERSION)
        ok = await post(url, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": USER},
                        VERSION)
    assert status == 400 and orjson.loads(raw) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "prefill not supported"}}
    assert ok[0] == 200
