"""The relay over real loopback sockets: byte-exactness, no buffering, headers, failures."""
from __future__ import annotations

import random
import time

import aiohttp
import orjson
import pytest

from gateway import config
from gateway.ops.server import build_app
from tests.support.servers import serve_app
from tests.support.upstreams import CANCELLED, REQUESTS, scripted_app
from tests.support.waiting import wait_until


def chunk(delta: dict, *, finish: str | None = None, crlf: bool = False) -> bytes:
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    end = b"\r\n\r\n" if crlf else b"\n\n"
    return b"data: " + orjson.dumps(obj) + end


ROLE = chunk({"role": "assistant", "content": ""})
FINISH = chunk({}, finish="stop")
USAGE = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
         b'"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n\n')
DONE = b"data: [DONE]\n\n"


def gateway_config(upstream_base: str, **server) -> config.Config:
    return config.parse({"auth": {"mode": "open"}, "server": {"access_log": False, **server},
                         "backends": [{"name": "up", "base_url": upstream_base + "/v1"}]})


async def post_stream(base: str, body: dict,
                      headers: dict | None = None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
            return r.status, dict(r.headers), await r.read()


def split_randomly(data: bytes, rng: random.Random) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        n = rng.choice([1, 1, 2, 3, 7, 64, 1000, 70000])
        out.append(data[i:i + n])
        i += n
    return out


def stream_body(rng: random.Random, *, crlf: bool) -> list[bytes]:
    """A realistic but nasty upstream: comments, event/id/retry lines, multi-line data, a 1 MB
    data line, CRLF framing."""
    nl = b"\r\n" if crlf else b"\n"
    events = [b": keep-alive" + nl + nl, ROLE.replace(b"\n", nl)]
    for i in range(20):
        events.append(chunk({"content": f" tok{i}"}).replace(b"\n\n", nl + nl))
        if i == 5:
            events.append(b"id: 7" + nl + b"retry: 1000" + nl + b": ping" + nl + nl)
        if i == 9:
            big = {"tool_calls": [{"index": 0, "function": {"arguments": "x" * 1_000_000}}]}
            events.append(chunk(big).replace(b"\n\n", nl + nl))
        if i == 12:
            events.append(b"event: message" + nl
                          + b'data: {"id":"chatcmpl-1","choices":[{"index":0,'
                          + nl + b'data: "delta":{"content":"multi"}}]}' + nl + nl)
    events.append(FINISH.replace(b"\n\n", nl + nl))
    return events


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("client_usage", [False, True])
async def test_byte_exact_under_any_chunking(seed: int, client_usage: bool) -> None:
    rng = random.Random(seed)
    crlf = seed == 2
    events = stream_body(rng, crlf=crlf)
    usage = USAGE.replace(b"\n\n", b"\r\n\r\n") if crlf else USAGE
    done = DONE.replace(b"\n\n", b"\r\n\r\n") if crlf else DONE
    upstream_bytes = b"".join(events) + usage + done
    writes = split_randomly(upstream_bytes, rng)
    app = scripted_app(writes)
    async with serve_app(app) as up, serve_app(build_app(gateway_config(up))) as gw:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        if client_usage:
            body["stream_options"] = {"include_usage": True}
        status, headers, got = await post_stream(gw, body)
    assert status == 200
    expected = upstream_bytes if client_usage else b"".join(events) + done
    assert got == expected
    sent = app[REQUESTS][0]["body"]
    assert sent["stream_options"] == {"include_usage": True}


async def test_usage_chunk_split_across_reads_with_crlf_is_removed_cleanly() -> None:
    usage = USAGE.replace(b"\n\n", b"\r\n\r\n")
    # The usage event's final CR and LF arrive in different reads.
    script = [ROLE, chunk({"content": "a"}), usage[:-1], 0.01, usage[-1:] + DONE]
    async with serve_app(scripted_app(script)) as up, \
            serve_app(build_app(gateway_config(up))) as gw:
        _, _, got = await post_stream(gw, {"model": "m", "stream": True, "messages": []})
    assert got == ROLE + chunk({"content": "a"}) + DONE


async def test_unbuffered_token_reaches_client_before_next_is_written() -> None:
    tokens = [chunk({"content": f"t{k}"}) for k in range(4)]
    script: list = [ROLE]
    for t in tokens:
        script += [t, 0.3]
    script += [FINISH, DONE]
    app = scripted_app(script)
    seen: list[tuple[float, bytes]] = []
    async with serve_app(app) as up, serve_app(build_app(gateway_config(up))) as gw:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(gw + "/v1/chat/completions",
                              json={"model": "m", "stream": True, "messages": []}) as r:
                buf = b""
                async for data in r.content.iter_any():
                    buf += data
                    for k, t in enumerate(tokens):
                        if t in buf and all(k != i for i, _ in seen):
                            seen.append((k, time.monotonic() - t0))
    # Token k is written at ~0.3*k s and token k+1 only 300 ms later: the client must have
    # each token well before the next one exists upstream.
    times = dict(seen)
    assert sorted(times) == [0, 1, 2, 3]
    for k in range(3):
        assert times[k] < 0.3 * (k + 1) - 0.05, times


async def test_response_headers_event_stream() -> None:
    headers = {"Content-Type": "text/event-stream", "Connection": "keep-alive, x-hop",
               "X-Hop": "1", "Keep-Alive": "timeout=5", "X-Upstream-Thing": "kept",
               "Content-Encoding": "identity"}
    app = scripted_app([ROLE, chunk({"content": "a"}), FINISH, DONE], headers=headers)
    async with serve_app(app) as up, serve_app(build_app(gateway_config(up))) as gw:
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            async with s.post(gw + "/v1/chat/completions",
                              json={"model": "m", "stream": True, "messages": []},
                              headers={"Connection": "keep-alive, x-client-hop",
                                       "X-Client-Hop": "1", "X-Custom": "yes",
                                       "Authorization": "Bearer client-key",
                                       "Accept-Encoding": "gzip"}) as r:
                await r.read()
                got = r.headers
    assert got["X-Accel-Buffering"] == "no"
    assert got["Cache-Control"] == "no-cache, no-transform"
    assert "Content-Length" not in got
    assert "Content-Encoding" not in got
    assert "X-Hop" not in got and "Keep-Alive" not in got
    assert got["X-Upstream-Thing"] == "kept"
    assert got["x-slogate-request-id"]
    sent = {k.lower(): v for k, v in app[REQUESTS][0]["headers"].items()}
    assert "x-client-hop" not in sent
    assert sent["x-custom"] == "yes"
    assert "authorization" not in sent  # the client's credential is never forwarded by default
    assert sent["accept-encoding"] == "identity"


async def test_truncated_after_first_token_ends_with_error_event() -> None:
    app = scripted_app([ROLE, chunk({"content": "a"}), chunk({"content": "b"})], abort_at_end=True)
    async with serve_app(app) as up, serve_app(build_app(gateway_config(up))) as gw:
        status, _, got = await post_stream(gw, {"model": "m", "stream": True, "messages": []})
    assert status == 200
    assert got.startswith(ROLE + chunk({"content": "a"}) + chunk({"content": "b"}))
    last = got.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: ")
    err = orjson.loads(last[6:])
    assert err["error"]["code"] == "stream_truncated"
    assert b"[DONE]" not in got


async def test_truncated_mid_event_never_forwards_half_an_event() -> None:
    half = chunk({"content": "c"})[:25]
    app = scripted_app([ROLE, chunk({"content": "a"}), half], abort_at_end=True)
    async with serve_app(app) as up, serve_app(build_app(gateway_config(up))) as gw:
        _, _, got = await post_stream(gw, {"model": "m", "stream": True, "messages": []})
    events = got.split(b"\n\n")
    assert events[-1] == b""
    for ev in events[:-1]:
        orjson.loads(ev[6:])  # every event the client got is well-formed JSON


async def test_truncated_before_first_token_is_a_clean_502() -> None:
    app = scripted_app([ROLE, 0.01], abort_at_end=True)
    async with serve_app(app) as up, serve_app(build_app(gateway_config(up))) as gw:
        status, headers, got = await post_stream(gw, {"model": "m", "stream": True, "messages": []})
    assert status == 502
    assert orjson.loads(got)["error"]["code"] == "upstream_stream_truncated"


async def test_commit_on_headers_policy_forwards_role_chunk_at_once() -> None:
    app = scripted_app([ROLE, 0.5, chunk({"content": "a"}), FINISH, DONE])
    async with serve_app(app) as up:
        cfg = gateway_config(up, commit="headers")
        async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(gw + "/v1/chat/completions",
                              json={"model": "m", "stream": True, "messages": []}) as r:
                first = await r.content.readuntil(b"\n\n")
                assert time.monotonic() - t0 < 0.4
                assert first == ROLE
                await r.read()


async def test_upstream_429_passed_through_with_retry_after() -> None:
    body = b'{"error":{"message":"slow down","type":"rate_limit_error","param":null,"code":null}}'
    app = scripted_app([body], status=429, headers={"Content-Type": "application/json",
                                                     "Retry-After": "7"})
    async with serve_app(app) as up, serve_app(build_app(gateway_config(up))) as gw:
        status, headers, got = await post_stream(gw, {"model": "m", "stream": True, "messages": []})
    assert status == 429
    assert headers["Retry-After"] == "7"
    assert got == body


@pytest.mark.parametrize("payload,status,code", [
    (b"{not json", 400, "invalid_json"),
    (b"[1,2]", 400, "invalid_json"),
    (b"", 400, "invalid_json"),
    (b'{"messages":[]}', 400, "missing_model"),
    (b'{"model":"m","stream":"yes"}', 400, "invalid_type"),
])
async def test_bad_requests_get_openai_errors(payload: bytes, status: int, code: str) -> None:
    app = scripted_app([DONE])
    async with serve_app(app) as up, serve_app(build_app(gateway_config(up))) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw + "/v1/chat/completions", data=payload,
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == status
                err = (await r.json())["error"]
    assert err["code"] == code and err["message"] and "type" in err
    assert app[REQUESTS] == []


async def test_body_over_limit_is_413() -> None:
    async with serve_app(scripted_app([DONE])) as up:
        cfg = config.parse({"auth": {"mode": "open"},
                            "server": {"max_body_bytes": 1000, "access_log": False},
                            "backends": [{"name": "up", "base_url": up + "/v1"}]})
        async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
            big = orjson.dumps({"model": "m",
                                "messages": [{"role": "user", "content": "x" * 5000}]})
            async with s.post(gw + "/v1/chat/completions", data=big) as r:
                assert r.status == 413
                assert (await r.json())["error"]["code"] == "request_too_large"


async def test_unknown_model_is_404_and_backend_down_is_502() -> None:
    cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": False}, "backends": [
        {"name": "dead", "base_url": "http://127.0.0.1:9/v1", "models": ["known"]}]})
    async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
        async with s.post(gw + "/v1/chat/completions", json={"model": "nope"}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
        async with s.post(gw + "/v1/chat/completions", json={"model": "known"}) as r:
            assert r.status == 502
            err = (await r.json())["error"]
            assert err["code"] == "upstream_unreachable"
        async with s.get(gw + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["known"]
        async with s.get(gw + "/v1/nothing-here") as r:
            assert r.status == 404
            assert "error" in await r.json()
            assert r.headers["x-slogate-request-id"]
        for path in ("/v1/models", "/healthz", "/readyz", "/metrics"):
            async with s.get(gw + path) as r:
                assert r.headers["x-slogate-request-id"], path


async def test_alias_rewrites_model_upstream_only() -> None:
    app = scripted_app([ROLE, chunk({"content": "a"}), FINISH, DONE])
    async with serve_app(app) as up:
        cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": False}, "backends": [
            {"name": "up", "base_url": up + "/v1", "models": ["real-model"],
             "aliases": {"friendly": "real-model"}}]})
        async with serve_app(build_app(cfg)) as gw:
            status, _, _ = await post_stream(gw, {"model": "friendly", "stream": True,
                                                  "messages": []})
    assert status == 200
    assert app[REQUESTS][0]["body"]["model"] == "real-model"


async def test_client_disconnect_mid_stream_closes_upstream() -> None:
    script = [ROLE] + [x for k in range(50) for x in (chunk({"content": f"t{k}"}), 0.02)] + [DONE]
    app = scripted_app(script)
    async with serve_app(app) as up, serve_app(build_app(gateway_config(up))) as gw:
        async with aiohttp.ClientSession() as s:
            r = await s.post(gw + "/v1/chat/completions",
                             json={"model": "m", "stream": True, "messages": []})
            await r.content.readuntil(b"t2")
            r.close()
        await wait_until(lambda: app[CANCELLED], timeout=1.0, what="the upstream seeing the close")
