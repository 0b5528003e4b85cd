"""A real Prometheus server (Debian package `prometheus`) scraping given targets, for tests."""
from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from gateway.ops import demo
from tests.support.servers import stop_process

_PICK = random.SystemRandom()  # not the seeded `random`: every test worker would pick alike


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing holds, below the kernel's ephemeral range. One the kernel hands out
    (bind to port 0) is in that range, where any outgoing connection of another test may take
    it before the server under test binds it: "address already in use" on a busy host."""
    low = _ephemeral_low()
    for _ in range(100):
        port = _PICK.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            picked: int = s.getsockname()[1]
            return picked
    raise RuntimeError("no free port below the ephemeral range")


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    async def query(self, expr: str) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            async with s.get(self.url + "/api/v1/query", params={"query": expr}) as r:
                body = await r.json()
        if body.get("status") != "success":
            raise AssertionError(f"query failed: {expr}: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def scalar(self, expr: str) -> float | None:
        result = await self.query(expr)
        return float(result[0]["value"][1]) if result else None


@contextlib.asynccontextmanager
async def prometheus(targets: list[str],
                     rule_files: Sequence[str] = ()) -> AsyncIterator[Prometheus]:
    """Start Prometheus scraping `targets` (host:port) every second."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (make test installs the Debian package)"
    tmp = Path(tempfile.mkdtemp(prefix="slogate-prom-"))
    port = free_port()
    cfg = tmp / "prometheus.yml"
    rules = "".join(f"\n  - {r}" for r in rule_files)
    cfg.write_text(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:{rules or ' []'}
scrape_configs:
  - job_name: slogate
    static_configs:
      - targets: {targets!r}
""")
    with open(tmp / "prometheus.log", "wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen([binary, f"--config.file={cfg}",
                                 f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            await demo.wait_ready(url + "/-/ready", proc.poll)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {(tmp / 'prometheus.log').read_text()[-2000:]}") from None
        yield Prometheus(url)
    finally:
        stop_process(proc)
        shutil.rmtree(tmp, ignore_errors=True)
