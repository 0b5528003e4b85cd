"""A real redis-server (Debian package `redis-server`) on a free loopback port, in a temp dir,
with persistence off. It can be stopped and started again on the same port (outage tests)."""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.prometheus_server import free_port


class RedisServer:
    def __init__(self, binary: str, port: int, tmp: Path) -> None:
        self.binary = binary
        self.port = port
        self.tmp = tmp
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        with open(self.tmp / "redis.log", "ab") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                 str(self.tmp), "--save", "", "--appendonly", "no", "--daemonize", "no",
                 "--protected-mode", "no", "--loglevel", "warning"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log_text()[-2000:]}")
            if self._pong():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server not ready: {self.log_text()[-2000:]}")

    def stop(self) -> None:
        """SIGKILL: as abrupt as a crash (and nothing to persist anyway)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        p = self.tmp / "redis.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    assert Path(binary).exists(), \
        "redis-server is not installed (make test installs the Debian package redis-server)"
    tmp = Path(tempfile.mkdtemp(prefix="slogate-redis-"))
    server = RedisServer(binary, free_port(), tmp)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
