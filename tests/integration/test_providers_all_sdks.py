"""What every API format and official SDK must get from the gateway: a missing or wrong
gateway key is a 401 in the client's own error format and the upstream sees only its own key;
an upstream 429 with Retry-After reaches the SDK, whose own retry then works."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import anthropic
import cerebras.cloud.sdk as cerebras
import groq
import openai
import pytest

from gateway.edge.auth import hash_key
from tests.support.provider_stack import UPSTREAM_KEY, UPSTREAM_KEY_ENV, stack

GATEWAY_KEY = "gw-key-team-a"
MESSAGES = [{"role": "user", "content": "hi"}]


async def _openai_chat(base: str, key: str, retries: int = 0) -> str:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=retries) as c:
        stream = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3,
                                                 stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])


async def _openai_responses(base: str, key: str, retries: int = 0) -> str:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=retries) as c:
        return (await c.responses.create(model="m", input="hi", max_output_tokens=3)).output_text


async def _anthropic(base: str, key: str, retries: int = 0) -> str:
    async with anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=retries) as c:
        async with c.messages.stream(model="m", max_tokens=3, messages=MESSAGES) as stream:
            return "".join([t async for t in stream.text_stream])


async def _groq(base: str, key: str, retries: int = 0) -> str:
    async with groq.AsyncGroq(base_url=base, api_key=key, max_retries=retries) as c:
        stream = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3,
                                                 stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])


async def _cerebras(base: str, key: str, retries: int = 0) -> str:
    async with cerebras.AsyncCerebras(base_url=base, api_key=key, max_retries=retries,
                                      warm_tcp_connection=False) as c:
        return (await c.chat.completions.create(model="m", messages=MESSAGES,
                                                max_tokens=3)).choices[0].message.content


@dataclass(frozen=True)
class Format:
    backend_type: str
    base_path: str
    route: str
    call: Callable[..., Awaitable[str]]  # (gateway URL, key, retries) -> answer text
    auth_error: type[Exception]
    upstream_auth: tuple[str, str]  # header the upstream must see, and its value
    sim: dict[str, Any]

    def request(self) -> dict[str, Any]:
        key = "input" if self.route.endswith("responses") else "messages"
        return {"model": "m", "max_tokens": 3, key: MESSAGES if key == "messages" else "hi"}


BEARER = ("authorization", f"Bearer {UPSTREAM_KEY}")
FORMATS = {
    "openai-chat": Format("openai", "/v1", "/v1/chat/completions", _openai_chat,
                          openai.AuthenticationError, BEARER, {}),
    "openai-responses": Format("openai", "/v1", "/v1/responses", _openai_responses,
                               openai.AuthenticationError, BEARER, {}),
    "anthropic": Format("anthropic", "/v1", "/v1/messages", _anthropic,
                        anthropic.AuthenticationError, ("x-api-key", UPSTREAM_KEY), {}),
    "groq": Format("groq", "/openai/v1", "/openai/v1/chat/completions", _groq,
                   groq.AuthenticationError, BEARER, {}),
    "cerebras": Format("cerebras", "/v1", "/v1/chat/completions", _cerebras,
                       cerebras.AuthenticationError, BEARER, {"provider": "cerebras"}),
}


def assert_auth_error(fmt: Format, body: dict[str, Any], code: str) -> None:
    if fmt.backend_type == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert set(body["error"]) == {"type", "message"}
    else:
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == code


@pytest.mark.parametrize("name", FORMATS)
async def test_gateway_key_per_api_format(name: str, monkeypatch) -> None:
    fmt = FORMATS[name]
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    keys = {"mode": "keys", "keys": [{"tenant": "team-a", "sha256": hash_key(GATEWAY_KEY)}]}
    async with stack(fmt.backend_type, fmt.base_path, auth=keys,
                     sim={"api_key": UPSTREAM_KEY, **fmt.sim},
                     backend={"api_key_env": UPSTREAM_KEY_ENV}) as s:
        assert await fmt.call(s.gw, GATEWAY_KEY)
        with pytest.raises(fmt.auth_error) as wrong:
            await fmt.call(s.gw, "not-a-gateway-key")
        assert wrong.value.status_code == 401
        headers = {"anthropic-version": "2023-06-01"}
        async with aiohttp.ClientSession() as http:
            async with http.post(s.gw + fmt.route, json=fmt.request(), headers=headers) as r:
                assert r.status == 401
                assert_auth_error(fmt, await r.json(), "missing_api_key")
            async with http.post(s.gw + fmt.route, json=fmt.request(),
                                 headers={**headers, "x-api-key": "not-a-gateway-key"}) as r:
                assert r.status == 401
                assert_auth_error(fmt, await r.json(), "invalid_api_key")
        (seen,) = await s.sim_requests()  # only the authorised request went upstream
        records = await s.records(4)
    name, value = fmt.upstream_auth
    assert seen["path"] == fmt.base_path + fmt.route.rsplit("/v1", 1)[1]
    assert seen["headers"][name] == value
    assert GATEWAY_KEY not in repr(seen["headers"])
    assert {"authorization", "x-api-key"} & set(seen["headers"]) == {name}
    assert records[0]["tenant"] == "team-a" and records[0]["outcome"] == "ok"
    assert GATEWAY_KEY not in repr(records) and UPSTREAM_KEY not in repr(records)


@pytest.mark.parametrize("name", ["openai-chat", "anthropic", "groq", "cerebras"])
async def test_upstream_429_retry_after_drives_the_sdk_retry(name: str) -> None:
    fmt = FORMATS[name]
    # The first upstream answer is a 429 asking for 50 ms; the gateway does not retry it
    # itself (one attempt), so it reaches the client with its Retry-After.
    sim = {**fmt.sim, "fault_status": 429, "fault_status_count": 1, "retry_after_s": 0.05}
    async with stack(fmt.backend_type, fmt.base_path, sim=sim, retry={"max_attempts": 1}) as s:
        assert await fmt.call(s.gw, "sk-client", retries=2)
        first, second = await s.sim_requests()
        records = await s.records(2)
    assert [r["status"] for r in records] == [429, 200]
    assert second["headers"]["x-stainless-retry-count"] == "1"
    # The SDK waited what the upstream asked, not its own backoff (0.375 s or more).
    assert 0.05 <= second["time"] - first["time"] < 0.3
