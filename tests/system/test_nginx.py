"""nginx in front of the gateway, as a user runs it: nothing buffers, keep-alive pings go
through (a real nginx: the Debian package `make test` installs)."""
from __future__ import annotations

import time

import aiohttp

from gateway import config
from gateway.ops.server import build_app
from tests.support.nginx_server import nginx_in_front_of
from tests.support.servers import serve_app
from tests.support.upstreams import scripted_app, tokens

MSG = [{"role": "user", "content": "hello"}]


def gw(backends: list[tuple[str, str]], **sections: object) -> config.Config:
    raw: dict[str, object] = {
        "auth": {"mode": "open"}, "server": {"access_log": True},
        "backends": [{"name": n, "base_url": u + "/v1", "models": ["m"]} for n, u in backends]}
    raw.update(sections)
    return config.parse(raw, env={})


async def test_keepalive_pings_keep_a_silent_stream_alive_through_nginx() -> None:
    """nginx (gzip on for event streams, 3 s read timeout) in front; the upstream goes silent
    for 4.5 s after the first token. Pings keep the connection alive and arrive unbuffered."""
    script = tokens(1, 0.0) + [4.5] + tokens(1, 0.0) + [b"data: [DONE]\n\n"]
    up = scripted_app(script)
    async with serve_app(up) as up_url, serve_app(build_app(gw(
            [("a", up_url)], server={"keepalive_s": 0.5, "access_log": False},
            timeouts={"idle_s": 10}))) as base:
        with nginx_in_front_of(base.removeprefix("http://").join(("http://", ""))) as front:
            seen: list[tuple[float, bytes]] = []
            async with aiohttp.ClientSession() as s:
                t0 = time.monotonic()
                async with s.post(front + "/v1/chat/completions",
                                  json={"model": "m", "stream": True, "messages": MSG}) as r:
                    assert r.status == 200
                    async for line in r.content:
                        seen.append((time.monotonic() - t0, line))
    lines = [line for _, line in seen]
    assert lines[-2:] == [b"data: [DONE]\n", b"\n"]
    pings = [t for t, line in seen if line == b": ping\n"]
    first_token = next(t for t, line in seen if b"t0 " in line)
    assert first_token < 1.0  # not held back by nginx or gzip
    assert len(pings) >= 6 and pings[0] < 1.5  # every 0.5 s of silence, as they happen
