"""Mid-stream continuation: a stream cut or stalled after its first token is finished by a
backend that can continue a prefill (`continuation = "prefill"`), spliced into the client's
stream — the same answer id, no text duplicated or lost, usage that counts what the client
received — through the official openai SDK; a backend that cannot is never sent a prefill."""
from __future__ import annotations

import logging
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.upstreams import REQUESTS, sequenced_app, tokens

FAST = dict(decode_base_ms=1.0, decode_per_seq_ms=0.0, prefill_tokens_per_s=1e9)
MSG = [{"role": "user", "content": "Tell me about rivers."}]
REQUEST: dict[str, Any] = dict(model="m", messages=MSG, max_tokens=24, seed=7,
                               stream_options={"include_usage": True})


def gw(urls: dict[str, str], prefill: set[str], **sections: Any) -> config.Config:
    raw: dict[str, Any] = {"auth": {"mode": "open"}, "backends": [
        {"name": name, "base_url": url + "/v1", "models": ["m"],
         "continuation": "prefill" if name in prefill else ""}
        for name, url in urls.items()]}
    raw.update(sections)
    return config.parse(raw, env={})


class Answer:
    def __init__(self) -> None:
        self.text = ""
        self.ids: set[str] = set()
        self.roles = 0
        self.finish: list[str] = []
        self.usage: Any = None


async def stream(base: str, **kw: Any) -> Answer:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    out = Answer()
    try:
        async for c in await client.chat.completions.create(stream=True, **{**REQUEST, **kw}):
            out.ids.add(c.id)
            if c.usage is not None:
                out.usage = c.usage
            for ch in c.choices:
                out.text += ch.delta.content or ""
                out.roles += ch.delta.role is not None
                if ch.finish_reason:
                    out.finish.append(ch.finish_reason)
        return out
    finally:
        await client.close()


async def metric(base: str, name: str) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            b = line.split('backend="', 1)[1].split('"', 1)[0]
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[(b, result)] = float(line.rsplit(" ", 1)[1])
    return out


async def test_a_stream_cut_after_its_first_tokens_is_continued_exactly(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "slogate.access")
    cut, whole = build_sim(SimConfig(cut_after=5, **FAST)), build_sim(SimConfig(**FAST))
    async with serve_app(cut) as cut_url, serve_app(whole) as whole_url:
        unbroken = await stream(whole_url)
        cfg = gw({"cut": cut_url, "whole": whole_url}, prefill={"cut", "whole"},
                 server={"access_log": True})
        async with serve_app(build_app(cfg)) as base:
            got = await stream(base)
            assert got.text == unbroken.text and len(unbroken.text) > 20
            assert len(got.ids) == 1 and got.roles == 1 and got.finish == unbroken.finish
            # the client's usage counts what it received, as the unbroken answer's does
            assert (got.usage.prompt_tokens, got.usage.completion_tokens) == \
                (unbroken.usage.prompt_tokens, unbroken.usage.completion_tokens)
            assert await metric(base, "slogate_continuations_total") == {("whole", "ok"): 1}
            assert await metric(base, "slogate_upstream_attempts_total") == {
                ("cut", "cut"): 1, ("whole", "ok"): 1}
            [rec] = [orjson.loads(r.getMessage()) for r in caplog.records
                     if r.name == "slogate.access"]
            assert rec["outcome"] == "ok" and rec["continued_from_token"] == [5]
            assert rec["attempts"] == [{"backend": "cut", "result": "cut",
                                        "ms": rec["attempts"][0]["ms"]}]
            assert rec["completion_tokens"] == unbroken.usage.completion_tokens
            assert rec["ms"]["ttft"] > 0 and rec["ms"]["e2e"] >= rec["ms"]["ttft"]


@pytest.mark.parametrize("cut_continues", [False, True])
async def test_a_backend_without_continuation_is_never_sent_a_prefill(
        cut_continues: bool) -> None:
    cut, other = build_sim(SimConfig(cut_after=5, **FAST)), sequenced_app([])
    async with serve_app(cut) as cut_url, serve_app(other) as other_url:
        cfg = gw({"cut": cut_url, "other": other_url},
                 prefill={"cut"} if cut_continues else set())
        async with serve_app(build_app(cfg)) as base:
            with pytest.raises(openai.APIError, match="before it was complete"):
                await stream(base)
            assert other[REQUESTS] == []  # it cannot continue: it gets no prefill
            # the one that can is asked to (and is cut again)
            assert await metric(base, "slogate_continuations_total") == (
                {("cut", "cut"): 1} if cut_continues else {})


async def test_a_stalled_stream_is_continued_from_the_text_it_sent() -> None:
    stalls = sequenced_app([(200, {"Content-Type": "text/event-stream"}, [*tokens(2, 0.0), 30.0])])
    whole = build_sim(SimConfig(**FAST))
    async with serve_app(stalls) as s_url, serve_app(whole) as w_url:
        cfg = gw({"stalls": s_url, "whole": w_url}, prefill={"whole"},
                 timeouts={"idle_s": 0.3})
        async with serve_app(build_app(cfg)) as base:
            got = await stream(base)
        [req] = [r for r in (await sim_requests(w_url)) if r["path"] == "/v1/chat/completions"]
        body = req["body"]
        assert body["messages"][-1] == {"role": "assistant", "content": "t0 t1 "}
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
        assert body["max_tokens"] == REQUEST["max_tokens"] - 2
        assert got.text.startswith("t0 t1 ") and len(got.text) > len("t0 t1 ")
        assert got.finish == ["length"] and len(got.ids) == 1, got.ids


async def test_continuations_are_capped_and_then_the_stream_ends_with_its_error() -> None:
    a, b = (build_sim(SimConfig(cut_after=3, **FAST)) for _ in range(2))
    async with serve_app(a) as a_url, serve_app(b) as b_url:
        cfg = gw({"a": a_url, "b": b_url}, prefill={"a", "b"}, retry={"max_continuations": 2})
        async with serve_app(build_app(cfg)) as base:
            with pytest.raises(openai.APIError, match="before it was complete"):
                await stream(base)
            assert sum((await metric(base, "slogate_continuations_total")).values()) == 2


async def sim_requests(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/sim/requests") as r:
        out: list[dict[str, Any]] = await r.json()
        return out


async def anthropic_text(base: str) -> tuple[str, Any, list[str]]:
    """The text, usage and event types of a streamed Messages answer, via the anthropic SDK."""
    client = AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
    try:
        async with client.messages.stream(model="m", max_tokens=24, messages=MSG) as s:
            kinds = [e.type async for e in s]
            final = await s.get_final_message()
        return "".join(b.text for b in final.content if b.type == "text"), final.usage, kinds
    finally:
        await client.close()


async def test_a_messages_stream_is_continued_by_an_anthropic_prefill_exactly() -> None:
    # The cut falls after a token that ends in a space: Anthropic refuses a prefill ending in
    # whitespace, so the prefill leaves it out and the continuation's repeat of it is dropped.
    cut, whole = build_sim(SimConfig(cut_after=5, **FAST)), build_sim(SimConfig(**FAST))
    async with serve_app(cut) as cut_url, serve_app(whole) as whole_url:
        unbroken, usage, _ = await anthropic_text(whole_url)
        cfg = config.parse({"auth": {"mode": "open"}, "backends": [
            {"name": n, "type": "anthropic", "base_url": u + "/v1", "models": ["m"],
             "continuation": "prefill"} for n, u in (("cut", cut_url), ("whole", whole_url))]},
            env={})
        async with serve_app(build_app(cfg)) as base:
            got, got_usage, kinds = await anthropic_text(base)
            assert got == unbroken and len(unbroken) > 20
            assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
            assert (got_usage.input_tokens, got_usage.output_tokens) == \
                (usage.input_tokens, usage.output_tokens)
            assert await metric(base, "slogate_continuations_total") == {("whole", "ok"): 1}
        [req] = [r for r in await sim_requests(whole_url) if r["path"] == "/v1/messages"][-1:]
        prefill = req["body"]["messages"][-1]
        assert prefill["role"] == "assistant" and prefill["content"] == prefill["content"].rstrip()
        assert unbroken.startswith(prefill["content"]) and req["body"]["max_tokens"] == 24 - 5


async def test_a_backend_error_after_the_first_tokens_is_continued_and_never_reaches_the_client(
        ) -> None:
    err, whole = build_sim(SimConfig(error_after=5, **FAST)), build_sim(SimConfig(**FAST))
    async with serve_app(err) as err_url, serve_app(whole) as whole_url:
        unbroken = await stream(whole_url)
        async with serve_app(build_app(gw({"err": err_url, "whole": whole_url},
                                          prefill={"whole"}))) as base:
            got = await stream(base)  # the SDK would raise on the error event
            assert got.text == unbroken.text and got.finish == unbroken.finish
            assert await metric(base, "slogate_upstream_attempts_total") == {
                ("err", "in_band_error"): 1, ("whole", "ok"): 1}


async def test_when_no_continuation_succeeds_the_stream_ends_with_the_backends_own_error(
        ) -> None:
    # the backend asked to continue refuses the prefill: the client gets the first backend's
    # error event, held back meanwhile, as that backend sent it
    err, refuses = build_sim(SimConfig(error_after=5, **FAST)), \
        build_sim(SimConfig(continuation=False, **FAST))
    async with serve_app(err) as err_url, serve_app(refuses) as refuses_url:
        with pytest.raises(openai.APIError) as direct:
            await stream(err_url)
        async with serve_app(build_app(gw({"err": err_url, "refuses": refuses_url},
                                          prefill={"refuses"}))) as base:
            with pytest.raises(openai.APIError) as through:
                await stream(base)
            assert through.value.message == direct.value.message  # its words, as it sent them
            assert await metric(base, "slogate_continuations_total") == {
                ("refuses", "http_400"): 1}
