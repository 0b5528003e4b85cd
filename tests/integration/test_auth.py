"""Gateway keys vs upstream keys, with the official openai SDK."""
from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from openai import AsyncOpenAI

from gateway import config
from gateway.edge.auth import hash_key
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.upstreams import REQUESTS, scripted_app

ROLE = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
        b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n')
TOKEN = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
         b'[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n')


def keyed_config(upstream: str, **backend) -> config.Config:
    return config.parse({
        "server": {"access_log": True},
        "auth": {"mode": "keys", "keys": [
            {"tenant": "team-a", "sha256": hash_key("gw-key-a")},
            {"tenant": "team-b", "sha256": hash_key("gw-key-b"), "models": ["other-model"]}]},
        "backends": [{"name": "up", "base_url": upstream + "/v1", "models": ["m", "other-model"],
                      "api_key_env": "SLOGATE_TEST_UPSTREAM_KEY", **backend}]}, env={})


async def test_keys(monkeypatch, caplog) -> None:
    monkeypatch.setenv("SLOGATE_TEST_UPSTREAM_KEY", "sk-upstream-secret")
    up = scripted_app([ROLE, TOKEN, b"data: [DONE]\n\n"])
    async with serve_app(up) as up_url, serve_app(build_app(keyed_config(up_url))) as gw:
        async def chat(key: str):
            client = AsyncOpenAI(base_url=gw + "/v1", api_key=key, max_retries=0)
            try:
                stream = await client.chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": "x"}])
                return "".join([c.choices[0].delta.content or "" async for c in stream])
            finally:
                await client.close()

        assert await chat("gw-key-a") == "hi"
        with pytest.raises(openai.AuthenticationError) as e:
            await chat("wrong-key")
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.PermissionDeniedError) as e:
            await chat("gw-key-b")  # not allowed this model
        assert e.value.body["code"] == "model_not_allowed"
        client = AsyncOpenAI(base_url=gw + "/v1", api_key="gw-key-b", max_retries=0)
        assert [m.id async for m in client.models.list()] == ["other-model"]
        await client.close()
    assert len(up[REQUESTS]) == 1
    sent = {k.lower(): v for k, v in up[REQUESTS][0]["headers"].items()}
    assert sent["authorization"] == "Bearer sk-upstream-secret"
    assert "gw-key-a" not in repr(sent)
    logs = caplog.text
    assert "team-a" in logs
    for secret in ("gw-key-a", "gw-key-b", "wrong-key", "sk-upstream-secret"):
        assert secret not in logs


async def test_missing_key_and_x_api_key(monkeypatch) -> None:
    import aiohttp

    up = scripted_app([ROLE, TOKEN, b"data: [DONE]\n\n"])
    async with serve_app(up) as up_url, serve_app(build_app(keyed_config(up_url))) as gw, \
            aiohttp.ClientSession() as s:
        body = {"model": "m", "stream": True, "messages": []}
        async with s.post(gw + "/v1/chat/completions", json=body) as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "missing_api_key"
        async with s.post(gw + "/v1/chat/completions", json=body,
                          headers={"x-api-key": "gw-key-a"}) as r:
            assert r.status == 200
            await r.read()
    # No upstream key configured: the client's credential is not forwarded either.
    sent = {k.lower() for k in up[REQUESTS][0]["headers"]}
    assert "authorization" not in sent and "x-api-key" not in sent


def test_hash_key_command() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "hash-key"], input="gw-key-a\n",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == hash_key("gw-key-a")
