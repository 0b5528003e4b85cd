"""A client that reads slower than the engine writes, over real loopback sockets against the
engine simulator: once its buffers are full the gateway stops reading the upstream and goes
on when the client reads again; the stream arrives whole; the access
log says how long the client held it; and the stream's TPOT, which then measures the client's
reading and not the engine's decoding, does not teach admission's TPOT fit (it would refuse
every tenant's tight-TPOT requests on a slow engine that is not)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.edge.auth import hash_key
from gateway.ops.server import build_app
from tests.support.servers import serve_app

TOKENS = 1500  # ~300 KB of SSE: several times the buffers the test leaves between the two
PAUSE_S = 0.8  # how long the slow client reads nothing


def gateway_config(sim: str) -> config.Config:
    return config.parse({
        "auth": {"mode": "keys", "keys": [{"tenant": "reader", "sha256": hash_key("k-reader")}],
                 "admin_keys": [{"sha256": hash_key("adm")}]},
        "server": {"access_log": True},
        "admission": {"enabled": True},
        "backends": [{"name": "sim", "base_url": sim + "/v1", "models": ["m"]}]}, env={})


@contextlib.asynccontextmanager
async def serve_with_small_send_buffers(app: web.Application) -> AsyncIterator[str]:
    """Run `app` on a listener with a small fixed send buffer (accepted sockets inherit it):
    on loopback the kernel grows a socket's send buffer to megabytes, so the gateway's own
    buffer would fill only after a very long stream; across a real network it fills sooner."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()
        sock.close()


async def slow_stream(gw: str, pause_s: float) -> bytes:
    """A streamed chat completion read by a client with a small receive buffer that reads
    nothing for `pause_s` after sending its request, then everything."""
    host, port = gw.removeprefix("http://").rsplit(":", 1)
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, int(port)))
    body = orjson.dumps({"model": "m", "stream": True, "max_tokens": TOKENS,
                         "messages": [{"role": "user", "content": "hello"}]})
    await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                            b"Authorization: Bearer k-reader\r\nConnection: close\r\n"
                            b"Content-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    await asyncio.sleep(pause_s)  # the scenario: a client that stops reading for a while
    got = bytearray()
    try:
        while chunk := await loop.sock_recv(sock, 65536):
            got += chunk
    finally:
        sock.close()
    return bytes(got)


def dechunk(raw: bytes) -> bytes:
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    out = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        rest = rest[size + 2:]


async def tpot_observations(s: aiohttp.ClientSession, gw: str) -> int:
    async with s.get(gw + "/admin/admission", headers={"Authorization": "Bearer adm"}) as r:
        n: int = (await r.json())["replicas"]["sim"]["tpot_model"]["observations"]
        return n


def records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "slogate.access"]


async def test_a_slow_reader_gets_its_whole_stream_and_teaches_admission_no_tpot(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="slogate.access")
    fast = SimConfig(decode_base_ms=0.2, decode_per_seq_ms=0, prefill_tokens_per_s=1e6,
                     output_tokens_sigma=0)
    async with serve_app(build_sim(fast)) as sim, \
            serve_with_small_send_buffers(build_app(gateway_config(sim))) as gw, \
            aiohttp.ClientSession() as s:
        body = {"model": "m", "stream": True, "max_tokens": 20,
                "messages": [{"role": "user", "content": "hello"}]}
        async with s.post(gw + "/v1/chat/completions", json=body,
                          headers={"Authorization": "Bearer k-reader"}) as r:
            assert r.status == 200
            await r.read()
        assert await tpot_observations(s, gw) == 1  # a stream read at once teaches the fit

        raw = await slow_stream(gw, PAUSE_S)
        events = [e for e in dechunk(raw).split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        tokens = sum(1 for e in events[:-1]
                     if orjson.loads(e[6:])["choices"]
                     and orjson.loads(e[6:])["choices"][0]["delta"].get("content"))
        assert tokens == TOKENS  # nothing lost while the upstream waited

        slow = records(caplog)[-1]
        assert slow["outcome"] == "ok"
        # the gateway stopped reading the upstream for about as long as the client did
        assert PAUSE_S * 1e3 * 0.5 < slow["ms"]["client_paused"] < PAUSE_S * 1e3 * 2, slow
        assert "client_paused" not in records(caplog)[0]["ms"]
        assert await tpot_observations(s, gw) == 1  # the client's pace taught nothing
