"""`slogate serve --workers N`: N worker processes on one port, and their supervisor.

One gateway process uses one core. With `--workers N` (`auto`: the number of usable cores) the
command becomes a small supervisor that

- checks the config and the port once (a bad config or a taken port stops it with status 2, as
  a single gateway does), and holds the port (a bound, not listening, SO_REUSEPORT socket) so a
  worker that restarts gets it back;
- starts N workers (`python -m gateway serve … --worker DIR,INDEX,N`), each a whole gateway
  listening on the same port with SO_REUSEPORT: the kernel spreads new connections across them
  by a hash of the connection's addresses;
- relays every line the workers write on stderr (the access log, warnings) to its own stderr,
  whole lines only, so lines of two workers never interleave, however long;
- restarts a worker that exits while the host is serving (logged with its status, counted in
  `slogate_worker_restarts_total`; after an exit within a second of its start the next start
  waits, up to 30 s, so a crash loop does not spin), after freeing what the dead worker held: its
  admission slots (SlotTable) and its gauges (its counters are folded into the host's, so no
  counter of the host's `/metrics` ever goes backwards: telemetry/aggregate.py);
- on SIGTERM / SIGINT, sends SIGTERM to every worker, each of which drains as a single gateway
  does (readiness 503, readiness grace, stop listening, drain_timeout_s, then error events), and
  exits 0 once all have.

What workers share lives in a run directory (a fresh temp dir, removed at exit):
`metrics/` (every worker's exposition, telemetry/aggregate.py), `admission/` (each worker's
admission snapshot, for /admin/admission's host view and the other workers' prefill work) and
`slots` (admission/hostlocal.py's SlotTable: caps exact across workers without Redis).

Listener limits stay per worker (each worker's aiohttp site has its own guard):
`max_connections` is split evenly (floor(max / N) per worker, so the host never holds more than
configured). `max_connections_per_client` is split with a margin: the kernel hashes a client's
connections over the workers by source port, so a client at its cap has a binomial share on
each worker; each worker allows cap/N plus three standard deviations of that share (256 over 2
workers: 152 each), so a client within its cap is not refused for an uneven hash, and a host
holds at most N × that (1.19× the cap for 256 over 2). The descriptor budget is per process,
as before.
"""
from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.admission.hostlocal import HostLocalState, SlotTable
from gateway.telemetry import aggregate

log = logging.getLogger("slogate")

PUBLISH_INTERVAL_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
STOP_MARGIN_S = 15.0  # beyond readiness grace + drain: then a stopping worker is killed


def parse_workers(text: str) -> int:
    """`--workers` value: a positive integer, or `auto` (the cores this process may use)."""
    if text == "auto":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - not Linux
            return max(1, os.cpu_count() or 1)
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"--workers {text!r}: expected a positive integer or 'auto'") from None
    if n < 1:
        raise ValueError(f"--workers {text!r}: expected a positive integer or 'auto'")
    return n


# -- the worker's side -----------------------------------------------------------------------

@dataclass
class WorkerContext:
    """What one worker knows of the host: its index, the number of workers, the run dir."""

    run_dir: str
    index: int
    count: int
    supervisor: int = 0  # its pid: a worker whose parent is another one is orphaned
    table: SlotTable | None = field(default=None, repr=False)
    # this process in the files it publishes (a restarted worker is another source)
    source: str = field(default_factory=aggregate.source_id, repr=False, compare=False)

    @classmethod
    def parse(cls, spec: str) -> WorkerContext:
        run_dir, index, count, supervisor = spec.rsplit(",", 3)
        return cls(run_dir, int(index), int(count), int(supervisor))

    def exit_if_stuck(self, after_s: float) -> None:
        """Shutdown has begun: if this process is still here `after_s` later (something in
        its shutdown hangs), dump every thread's stack to the log and exit, so that a worker
        never outlives its supervisor's stop."""
        def stuck() -> None:
            log.error("worker %d: still shutting down after %.0f s; exiting (stacks below)",
                      self.index, after_s)
            faulthandler.dump_traceback(all_threads=True)
            os._exit(1)

        timer = threading.Timer(after_s, stuck)
        timer.daemon = True
        timer.start()

    def orphaned(self) -> bool:
        """The supervisor is gone (even if it died before this worker got this far)."""
        return os.getppid() != self.supervisor

    @property
    def metrics_dir(self) -> str:
        return os.path.join(self.run_dir, "metrics")

    @property
    def admission_dir(self) -> str:
        return os.path.join(self.run_dir, "admission")

    def slot_table(self) -> SlotTable:
        if self.table is None:
            self.table = SlotTable(os.path.join(self.run_dir, "slots"), self.count, self.index)
        return self.table

    def host_admission(self) -> HostLocalState:
        """Admission caps shared by the host's workers (no Redis configured)."""
        return HostLocalState(self.slot_table(), self.admission_dir)

    def label_logs(self) -> None:
        """This worker's log lines say which worker wrote them (the access log stays JSON)."""
        fmt = logging.Formatter(f"%(asctime)s %(levelname)s %(name)s[w{self.index}]: "
                                "%(message)s")
        for handler in logging.getLogger().handlers:
            handler.setFormatter(fmt)

    def split_connections(self, max_connections: int, per_client: int) -> tuple[int, int]:
        """This worker's share of the listener caps (see the module docstring)."""
        n = self.count
        share = per_client / n + 3 * math.sqrt(per_client * (1 / n) * (1 - 1 / n))
        return (max(1, max_connections // n),
                min(per_client, math.ceil(share)) if per_client else 0)

    def exposition(self, registry: Any, encoder: Any) -> bytes:
        return aggregate.host_exposition(registry, self.index, self.metrics_dir, encoder,
                                         self.source)

    def publish(self, registry: Any, admission: dict[str, Any] | None) -> None:
        aggregate.publish(self.metrics_dir, aggregate.worker_file(self.index),
                          aggregate.snapshot(registry, self.source))
        aggregate.publish(self.admission_dir, f"w{self.index}.json", orjson.dumps(
            {"worker": self.index, "pid": os.getpid(), "t": time.time(),
             "admission": admission}))

    async def publish_forever(self, registry: Any, snapshot: Any) -> None:
        while True:
            try:
                self.publish(registry, snapshot())
            except Exception as e:  # a full disk must not stop the worker
                log.warning("worker %d: could not publish metrics: %s", self.index, e)
            await asyncio.sleep(PUBLISH_INTERVAL_S)

    def host_admission_view(self, own: dict[str, Any]) -> dict[str, Any]:
        """/admin/admission on a multi-worker host: this worker's view, every worker's last
        published one, and the host's slot table."""
        workers: dict[str, Any] = {}
        for path in sorted(Path(self.admission_dir).glob("w*.json")):
            if path.stem == f"w{self.index}":
                continue
            with contextlib.suppress(OSError, orjson.JSONDecodeError):
                workers[path.stem[1:]] = orjson.loads(path.read_bytes())
        workers[str(self.index)] = {"worker": self.index, "pid": os.getpid(), "t": time.time(),
                                    "admission": own}
        view = dict(own)
        view["host"] = {
            "workers": self.count, "answered_by": self.index,
            "slots": self.table.snapshot() if self.table is not None else None,
            "by_worker": dict(sorted(workers.items(), key=lambda kv: int(kv[0]))),
        }
        return view


# -- the supervisor --------------------------------------------------------------------------

class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self.relay: asyncio.Task[None] | None = None
        self.failures = 0  # consecutive quick exits


class Supervisor:
    def __init__(self, config_path: str, host: str, port: int, count: int,
                 drain_timeout_s: float, grace_s: float = 0.0) -> None:
        self.config_path = config_path
        self.host = host
        self.port = port
        self.count = count
        self.drain_timeout_s = drain_timeout_s
        self.grace_s = grace_s  # readiness grace: a worker stops within grace + drain
        self.run_dir = tempfile.mkdtemp(prefix="slogate-workers-")
        for sub in ("metrics", "admission"):
            os.mkdir(os.path.join(self.run_dir, sub))
        self.table = SlotTable(os.path.join(self.run_dir, "slots"), count)
        self.workers = [_Worker(i) for i in range(count)]
        self.restarts = 0
        self.stopping = False
        self.exit_status = 0
        self._out = sys.stderr.buffer
        self._publish()

    def reserve_port(self) -> socket.socket:
        """Bind (not listen) the port with SO_REUSEPORT: a taken port is found here, port 0
        becomes a real one, and the workers bind it next to this socket."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        return sock

    def _argv(self, index: int) -> list[str]:
        return [sys.executable, "-m", "gateway", "serve", "--config", self.config_path,
                "--host", self.host, "--port", str(self.port),
                "--worker", f"{self.run_dir},{index},{self.count},{os.getpid()}"]

    async def _start(self, w: _Worker) -> None:
        w.proc = await asyncio.create_subprocess_exec(
            *self._argv(w.index), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
            env=worker_env(os.environ, w.index))
        w.started = time.monotonic()
        assert w.proc.stdout is not None
        w.relay = asyncio.create_task(self._relay(w.proc.stdout))
        log.info("worker %d started (pid %d)", w.index, w.proc.pid)

    async def _relay(self, stream: asyncio.StreamReader) -> None:
        """A worker's output, to our stderr one whole line per write (no interleaving)."""
        buf = b""
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                break
            buf += chunk
            end = buf.rfind(b"\n")
            if end < 0:
                continue
            self._write(buf[:end + 1])
            buf = buf[end + 1:]
        if buf:
            self._write(buf + b"\n")

    def _write(self, data: bytes) -> None:
        self._out.write(data)
        self._out.flush()

    def _publish(self) -> None:
        alive = sum(1 for w in self.workers if w.proc is not None and w.proc.returncode is None)
        restarts = CounterMetricFamily(
            "slogate_worker_restarts", "Worker processes restarted by the supervisor after "
            "they exited.", value=self.restarts)
        running = GaugeMetricFamily("slogate_workers", "Worker processes running on this host.",
                                    value=alive)
        configured = GaugeMetricFamily("slogate_workers_configured",
                                       "Worker processes configured (--workers).",
                                       value=self.count)
        aggregate.publish(os.path.join(self.run_dir, "metrics"), aggregate.SUPERVISOR,
                          aggregate.dump([restarts, running, configured]))

    async def _watch(self, w: _Worker) -> None:
        """Restart worker `w` whenever it exits while the host serves."""
        while True:
            assert w.proc is not None
            status = await w.proc.wait()
            if w.relay is not None:
                await w.relay
            self._reap(w)
            if self.stopping:
                return
            if status == 2 and time.monotonic() - w.started < 30:
                log.error("worker %d exited with status 2 (a config or listen error); "
                          "stopping", w.index)
                self.exit_status = 2
                self._stop()
                return
            quick = time.monotonic() - w.started < 1.0
            w.failures = w.failures + 1 if quick else 0
            delay = min(RESTART_BACKOFF_MAX_S, 0.5 * 2 ** (w.failures - 1)) if quick else 0.0
            self.restarts += 1
            log.warning("worker %d (pid %d) exited (%s); restarting it%s (restart %d)",
                        w.index, w.proc.pid, _describe_status(status),
                        f" in {delay:.1f} s" if delay else "", self.restarts)
            if delay:
                await asyncio.sleep(delay)
                if self._stopped():
                    return
            await self._start(w)
            self._publish()

    def _reap(self, w: _Worker) -> None:
        """What a dead worker held goes back: its admission slots, its gauges; its counters
        stay (folded into dead.json)."""
        freed = self.table.clear_worker(w.index)
        if freed:
            log.info("worker %d: freed its admission slots %s", w.index, freed)
        aggregate.fold_dead(os.path.join(self.run_dir, "metrics"), w.index)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.run_dir, "admission", f"w{w.index}.json"))
        self._publish()

    def _stopped(self) -> bool:
        return self.stopping

    def _stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        log.info("stopping %d workers (each drains up to %.0f s)", self.count,
                 self.drain_timeout_s)
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)
        asyncio.get_running_loop().call_later(self.stop_timeout_s(), self._kill_stragglers)

    def stop_timeout_s(self) -> float:
        return self.grace_s + self.drain_timeout_s + STOP_MARGIN_S

    def _kill_stragglers(self) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                log.error("worker %d (pid %d) did not stop within %.0f s; killing it", w.index,
                          w.proc.pid, self.stop_timeout_s())
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        for w in self.workers:
            await self._start(w)
        self._publish()
        log.info("supervisor: %d workers on http://%s:%d (pid %d)", self.count, self.host,
                 self.port, os.getpid())
        await asyncio.gather(*(self._watch(w) for w in self.workers))
        log.info("all workers stopped")
        return self.exit_status

    def cleanup(self) -> None:
        self.table.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def worker_env(env: Mapping[str, str], index: int) -> dict[str, str]:
    """A worker's environment: the supervisor's, with a `service.instance.id` of its own in
    OTEL_RESOURCE_ATTRIBUTES (the operator's, if set, with `/w<index>` appended), so the OTLP
    metrics of N workers are N series, not one series written by N processes."""
    out = dict(env)
    pairs = [p for p in out.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",") if "=" in p]
    attrs = dict(p.split("=", 1) for p in pairs)
    base = attrs.get("service.instance.id") or f"{socket.gethostname()}:{os.getpid()}"
    attrs["service.instance.id"] = f"{base}/w{index}"
    out["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(f"{k}={v}" for k, v in attrs.items())
    return out


def _describe_status(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"status {status}"


def supervise(config_path: str, host: str, port: int, count: int,
              drain_timeout_s: float, grace_s: float = 0.0) -> int:
    """Run N workers until SIGTERM; returns the exit status."""
    from gateway.transport.netdiag import describe_listen_error

    sup = Supervisor(os.path.abspath(config_path), host, port, count, drain_timeout_s,
                     grace_s)
    try:
        try:
            sock = sup.reserve_port()
        except OSError as e:
            print(f"slogate: {describe_listen_error(e, host, port)}", file=sys.stderr)
            return 2
        try:
            return asyncio.run(sup.run())
        finally:
            sock.close()
    finally:
        sup.cleanup()
