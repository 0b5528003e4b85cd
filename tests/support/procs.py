"""Run the real `slogate` commands as subprocesses (as a user would), on free ports."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from gateway.ops import demo
from tests.support.prometheus_server import free_port
from tests.support.servers import stop_process


class Proc:
    def __init__(self, popen: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.popen = popen
        self.url = url
        self.log = log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


async def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path,
                     timeout: float = 30) -> None:
    try:
        await demo.wait_ready(url, proc.poll, timeout)
    except RuntimeError as e:
        raise RuntimeError(f"{e}: {log.read_text()[-3000:]}") from None


@contextlib.asynccontextmanager
async def slogate(*args: str, ready_path: str, env: dict[str, str] | None = None,
                  port: int | None = None) -> AsyncIterator[Proc]:
    """`python -m gateway ARGS --port P`; yields once GET ready_path answers 200."""
    port = port or free_port()
    log = Path(tempfile.mkstemp(prefix="slogate-proc-", suffix=".log")[1])
    with open(log, "wb") as out:
        popen = subprocess.Popen([sys.executable, "-m", "gateway", *args, "--port", str(port)],
                                 stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url + ready_path, popen, log)
        yield Proc(popen, url, log)
    finally:
        stop_process(popen)
        if not os.environ.get("SLOGATE_KEEP_PROC_LOG"):
            log.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def sim_and_gateway(sim_args: tuple[str, ...] = (),
                          config_toml: str = "") -> AsyncIterator[tuple[Proc, Proc]]:
    """The simulator and a gateway in front of it, both as real processes. In `config_toml`,
    SIM_URL stands for the simulator's base URL."""
    async with slogate("sim", *sim_args, ready_path="/health") as sim:
        cfg = Path(tempfile.mkstemp(prefix="slogate-", suffix=".toml")[1])
        cfg.write_text(config_toml.replace("SIM_URL", sim.url) if config_toml else f"""
[auth]
mode = "open"
[server]
access_log = true
[[backends]]
name = "sim"
base_url = "{sim.url}/v1"
models = ["m"]
""")
        try:
            async with slogate("serve", "--config", str(cfg), ready_path="/readyz") as gw:
                yield sim, gw
        finally:
            cfg.unlink(missing_ok=True)
