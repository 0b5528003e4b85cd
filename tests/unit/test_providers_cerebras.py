"""Cerebras through the gateway with the official cerebras-cloud-sdk: time_info becoming
provider-reported stages, every field kept, and the SDK's /v1/tcp_warming answered locally."""
from __future__ import annotations

import asyncio
import logging

from cerebras.cloud.sdk import AsyncCerebras, Cerebras

from tests.support.provider_stack import assert_provider_stages, stack

MESSAGES = [{"role": "user", "content": "Why is fast inference important?"}]


def cerebras_stack(**kw):
    return stack("cerebras", sim={"provider": "cerebras"}, backend={"provider": "cerebras"}, **kw)


def client(base: str) -> AsyncCerebras:
    # The async client warms its connection with a *blocking* request from its constructor,
    # which would stall this event loop (the gateway's too): the warm-up has its own test.
    return AsyncCerebras(base_url=base, api_key="csk-client", max_retries=0,
                         warm_tcp_connection=False)


async def test_stream_time_info_and_fields_kept() -> None:
    async with cerebras_stack() as s:
        c = client(s.gw)
        stream = await c.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                 max_completion_tokens=6,
                                                 stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        await c.close()
        (rec,) = await s.records()
    last = chunks[-1]
    assert all(chunk.system_fingerprint == chunks[0].system_fingerprint for chunk in chunks)
    assert last.choices == [] and last.usage.completion_tokens == 6
    info = last.time_info
    assert info.total_time >= info.queue_time + info.prompt_time + info.completion_time - 1e-6
    assert_provider_stages(rec, info)
    assert rec["completion_tokens"] == 6 and rec["outcome"] == "ok"


async def test_whole_completion_and_legacy_completions() -> None:
    async with cerebras_stack() as s:
        c = client(s.gw)
        chat = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        text = await c.completions.create(model="m", prompt="Fast inference is", max_tokens=3)
        await c.close()
        chat_rec, text_rec = await s.records(2)
    assert chat.system_fingerprint and chat.usage.completion_tokens == 4
    assert_provider_stages(chat_rec, chat.time_info)
    assert text.choices[0].text and text_rec["completion_tokens"] == 3
    assert_provider_stages(text_rec, text.time_info)


async def test_usage_and_time_info_the_client_did_not_ask_for_are_not_dropped() -> None:
    async with cerebras_stack() as s:
        c = client(s.gw)
        stream = await c.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                 max_tokens=3)
        last = [chunk async for chunk in stream][-1]
        await c.close()
    assert last.time_info is not None  # what the client gets from Cerebras directly


async def test_tcp_warming_is_answered_by_the_gateway(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    async with cerebras_stack() as s:
        # The sync client warms up from its constructor: run it beside the gateway's loop.
        await asyncio.to_thread(lambda: Cerebras(base_url=s.gw, api_key="csk-client").close())
        seen = await s.sim_requests()
    assert not seen  # the upstream was not bothered
    assert "TCP Warming had exception" not in caplog.text
    assert 'GET http://127.0.0.1' in caplog.text
    assert '/v1/tcp_warming "HTTP/1.1 200 OK"' in caplog.text
