"""The admin listener ([server] admin_port) has the main listener's limits: a header deadline,
an idle timeout, a connection cap of its own inside the same descriptor budget, and it binds
loopback unless admin_host says otherwise. /admin/admission answers on either port.

The gateway runs as `slogate serve` (the serve path a user runs), except the descriptor budget
test, which runs the listeners in this process with a low descriptor limit.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway import config
from gateway.edge import listener
from gateway.ops import server
from tests.support import hostile
from tests.support.procs import Proc, slogate
from tests.support.prometheus_server import free_port
from tests.support.waiting import wait_until

CONFIG = """
[auth]
mode = "open"
[server]
host = "{host}"
access_log = false
header_timeout_s = {header_timeout_s}
admin_port = {admin_port}
admin_max_connections = {admin_max}
admin_metrics = true
admin_console = true
{extra}
[admission]
enabled = true
[[backends]]
name = "a"
base_url = "http://127.0.0.1:9/v1"
models = ["m"]
"""


@contextlib.asynccontextmanager
async def gateway(header_timeout_s: float = 10, admin_max: int = 64, host: str = "127.0.0.1",
                  extra: str = "") -> AsyncIterator[tuple[Proc, int]]:
    """`slogate serve` with an admin listener; yields (the process, the admin port)."""
    admin_port = free_port()
    cfg = Path(tempfile.mkstemp(prefix="slogate-admin-", suffix=".toml")[1])
    cfg.write_text(CONFIG.format(host=host, header_timeout_s=header_timeout_s,
                                 admin_port=admin_port, admin_max=admin_max, extra=extra))
    try:
        async with slogate("serve", "--config", str(cfg), ready_path="/readyz") as gw:
            await wait_until(lambda: _listening(admin_port), 10, what="admin listener")
            yield gw, admin_port
    finally:
        cfg.unlink(missing_ok=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _listen_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on `port`."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        addr, hex_port = fields[1].split(":")
        if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            out.add(addr)
    return out


async def test_admin_listener_times_out_trickled_headers_and_idle_connections() -> None:
    async with gateway(header_timeout_s=0.5) as (gw, admin):
        slow, idle = await asyncio.gather(hostile.slowloris("127.0.0.1", admin, every_s=0.05),
                                          hostile.idle_connection("127.0.0.1", admin))
        assert hostile.status_of(slow) == 408
        assert orjson.loads(hostile.body_of(slow))["error"]["code"] == "header_timeout"
        assert idle == b""  # closed without a word
        # A body announced and never sent is not held open either (aiohttp's lingering read
        # of an unread body, then the header deadline of the next request).
        raw = await hostile.raw_exchange(
            "127.0.0.1", admin, b"POST /admin/backends HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 1000\r\n\r\n{", timeout=8)
        assert hostile.status_of(raw) in (405, 408)
        async with aiohttp.ClientSession() as s, \
                s.get(f"http://127.0.0.1:{admin}/metrics") as r:
            text = await r.text()
        assert 'slogate_connections_rejected_total{reason="header_timeout"} 1.0' in text
        assert 'slogate_connections_rejected_total{reason="idle_timeout"} 1.0' in text


async def test_admin_connections_over_their_cap_get_503_and_the_main_port_still_serves() -> None:
    async with gateway(admin_max=3) as (gw, admin):
        held = [await asyncio.open_connection("127.0.0.1", admin) for _ in range(3)]
        try:
            # Every admin connection past the cap is refused at once, not held open (they
            # send nothing: bytes unread at the close could turn the 503 into a reset).
            refused = await asyncio.gather(*[hostile.idle_connection("127.0.0.1", admin, 5)
                                             for _ in range(20)])
            assert {hostile.status_of(r) for r in refused} == {503}
            assert orjson.loads(hostile.body_of(refused[0]))["error"]["code"] == \
                "max_connections"
            async with aiohttp.ClientSession() as s:
                async with s.get(gw.url + "/healthz") as r:
                    assert r.status == 200
        finally:
            for _, w in held:
                w.close()
        # Their slots come back.
        async def admin_answers() -> bool:
            async with aiohttp.ClientSession() as s, \
                    s.get(f"http://127.0.0.1:{admin}/admin/backends") as r:
                return r.status == 200
        await wait_until(admin_answers, 10, interval=0.05, what="admin slots freed")


async def test_admin_listener_binds_loopback_unless_told_otherwise() -> None:
    loopback = "0100007F"  # 127.0.0.1 in /proc/net/tcp's byte order
    async with gateway(host="0.0.0.0") as (gw, admin):
        assert _listen_addresses(admin) == {loopback}
        assert _listen_addresses(int(gw.url.rsplit(":", 1)[1])) == {"00000000"}
    async with gateway(extra='admin_host = "0.0.0.0"') as (gw, admin):
        assert _listen_addresses(admin) == {"00000000"}


@pytest.mark.parametrize("admin_port", [False, True])
async def test_admin_admission_answers_on_its_port(admin_port: bool) -> None:
    if admin_port:
        async with gateway() as (gw, admin):
            base = f"http://127.0.0.1:{admin}"
            await _admission_ok(base)
    else:
        cfg = Path(tempfile.mkstemp(prefix="slogate-admin-", suffix=".toml")[1])
        cfg.write_text(CONFIG.format(host="127.0.0.1", header_timeout_s=10, admin_port=0,
                                     admin_max=64, extra=""))
        try:
            async with slogate("serve", "--config", str(cfg), ready_path="/readyz") as gw:
                await _admission_ok(gw.url)
        finally:
            cfg.unlink(missing_ok=True)


async def _admission_ok(base: str) -> None:
    async with aiohttp.ClientSession() as s, s.get(base + "/admin/admission") as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    assert body["enabled"] is True and "a" in body["replicas"]


async def test_admin_connections_count_in_the_descriptor_budget(monkeypatch) -> None:
    """With 1,000 descriptors, the main listener's cap leaves room for the upstream pools,
    the admin listener's cap and the reserve."""
    def getrlimit(which: int) -> tuple[int, int]:
        return 1000, 1000

    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        raise ValueError("not allowed")  # (and this process keeps its real limits)

    monkeypatch.setattr(listener.resource, "getrlimit", getrlimit)
    monkeypatch.setattr(listener.resource, "setrlimit", setrlimit)
    raw: dict[str, Any] = {
        "auth": {"mode": "open"},
        "server": {"access_log": False, "max_connections": 4096, "admin_port": free_port(),
                   "admin_max_connections": 40},
        "backends": [{"name": "a", "base_url": "http://127.0.0.1:9/v1", "pool_size": 100}]}
    cfg = config.parse(raw, env={})
    app = server.build_app(cfg)
    runner, site = await server.start(app, cfg, "127.0.0.1", 0)
    try:
        admin_runner, admin_site = await server.start_admin(app, cfg)
        try:
            assert site.guard.max_connections == 1000 - 100 - 40 - 128
            assert admin_site.guard.max_connections == 40
        finally:
            await admin_runner.cleanup()
    finally:
        await runner.cleanup()
