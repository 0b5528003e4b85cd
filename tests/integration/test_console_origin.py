"""The console's origin (the gateway's address) serves nothing a hostile page could use: the
console answers only a Host it knows (DNS rebinding), its answers forbid framing, sniffing,
referrers and any script or style but its own, an upstream's HTML is never served there as a
document, and polling /console/state does not recompute the snapshot per request."""
from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway import config
from gateway.console import web as console_web
from gateway.ops.keys import CONSOLE_KEY
from gateway.ops.server import build_app
from tests.support.servers import serve_app

HTML = b"<html><script>fetch('/console/state').then(r => r.text()).then(alert)</script></html>"


def gateway_config(upstream: str, **server: Any) -> config.Config:
    return config.parse({"auth": {"mode": "open"},
                         "server": {"access_log": False, **server},
                         "retry": {"max_attempts": 1},
                         "backends": [{"name": "a", "base_url": upstream + "/v1",
                                       "models": ["m"]}]}, env={})


def html_upstream() -> web.Application:
    """An upstream whose answers (an error page, a success) are HTML."""
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        status = 400 if body.get("model") == "m" and body.get("stream") else 200
        return web.Response(status=status, body=HTML, content_type="text/html")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.mark.parametrize("stream", [True, False])
async def test_an_upstreams_html_is_never_a_document_on_the_gateways_origin(stream: bool) -> None:
    async with serve_app(html_upstream()) as up:
        async with serve_app(build_app(gateway_config(up))) as gw, aiohttp.ClientSession() as s:
            async with s.post(gw + "/v1/chat/completions", json={
                    "model": "m", "stream": stream,
                    "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == (400 if stream else 200)
                assert await r.read() == HTML  # the bytes pass through as they came
                assert r.headers["Content-Type"].startswith("text/plain")
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                assert "sandbox" in r.headers["Content-Security-Policy"]


async def test_console_answers_carry_the_security_headers() -> None:
    async with serve_app(build_app(gateway_config("http://127.0.0.1:9"))) as gw, \
            aiohttp.ClientSession() as s:
        for path in ("/console", "/console/static/console.js", "/console/static/console.css",
                     "/console/state", "/console/static/nope"):
            async with s.get(gw + path) as r:
                assert r.status == (404 if path.endswith("nope") else 200), path
                csp = r.headers["Content-Security-Policy"]
                assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, path
                assert "'unsafe-inline'" not in csp
                assert r.headers["X-Frame-Options"] == "DENY"
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                assert r.headers["Referrer-Policy"] == "no-referrer"
        async with s.get(gw + "/console/events") as r:
            assert r.headers["X-Frame-Options"] == "DENY"
            assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]


@pytest.mark.parametrize("host,allowed", [
    ("127.0.0.1:8080", True), ("localhost:8080", True), ("LOCALHOST.", True),
    ("app.localhost", True), ("[::1]:8080", True), ("10.1.2.3", True),
    ("gw.internal:8080", True),  # in console_hosts
    ("evil.example:8080", False), ("127.0.0.1.evil.example", False), ("localhost.evil", False),
])
async def test_console_answers_only_hosts_it_knows(host: str, allowed: bool) -> None:
    cfg = gateway_config("http://127.0.0.1:9", console_hosts=["gw.internal"])
    async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
        for path in ("/console", "/console/state", "/console/static/console.js"):
            async with s.get(gw + path, headers={"Host": host}) as r:
                assert r.status == (200 if allowed else 403), (host, path)
                if not allowed:
                    assert "console_hosts" in await r.text()
                    assert r.headers["X-Frame-Options"] == "DENY"
        async with s.get(gw + "/healthz", headers={"Host": host}) as r:
            assert r.status == 200  # the API and health routes are not the console's


async def test_console_hosts_star_allows_any() -> None:
    cfg = gateway_config("http://127.0.0.1:9", console_hosts=["*"])
    async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
        async with s.get(gw + "/console/state", headers={"Host": "anything.example"}) as r:
            assert r.status == 200


async def test_polling_console_state_does_not_recompute_it_per_request() -> None:
    app = build_app(gateway_config("http://127.0.0.1:9"))
    console = app[CONSOLE_KEY]
    computed = 0
    snapshot = console.snapshot

    def counted() -> dict[str, Any]:
        nonlocal computed
        computed += 1
        return snapshot()

    console.snapshot = counted  # type: ignore[method-assign]
    async with serve_app(app) as gw, aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        bodies = set()
        for _ in range(50):
            async with s.get(gw + "/console/state") as r:
                bodies.add(await r.read())
        elapsed = time.monotonic() - t0
    # At most one computation per STATE_MAX_AGE_S of the loop (and the first).
    assert computed <= 2 + elapsed / console_web.STATE_MAX_AGE_S, (computed, elapsed)
    assert len(bodies) <= computed
